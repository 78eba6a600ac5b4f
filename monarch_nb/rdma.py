"""PyTorch Monarch's ``monarch.rdma`` by its own names: ``RDMABuffer`` moves a tensor's bytes
between actors over the actors' own connections, as torchmonarch's TCP path does where there is
no RDMA hardware (monarch_nb/actors/rdma.py)."""

from monarch_nb.actors.rdma import RDMABuffer

__all__ = ["RDMABuffer"]
