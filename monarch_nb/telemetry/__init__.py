"""Telemetry: device samplers and ``log()`` on the workers, the bounded stores on the scheduler and
the controller, the scheduler's ``/monarch`` routes and the figures they share."""
