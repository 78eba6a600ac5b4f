import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { el, formatSince } from './format';
import { ICluster, IUnreachable } from './types';

/** The registered clusters, one line each; clicking one selects it. */
export class ClusterList extends Widget {
  constructor() {
    super();
    this.addClass('monarch-ClusterList');
    this._empty = el(
      'p',
      'monarch-empty',
      'No clusters yet. Run %monarch up in a notebook to start one.'
    );
    this._list = el('ul', 'monarch-cluster-items');
    this._unreachable = el('ul', 'monarch-unreachable');
    this.node.append(this._empty, this._list, this._unreachable);
    this._list.addEventListener('click', this._onClick);
  }

  get selectionChanged(): ISignal<this, string | null> {
    return this._selectionChanged;
  }

  get selected(): string | null {
    return this._selected;
  }

  /** Show `clusters`, keeping the selection while its cluster is listed, and one line for
   * each live cluster the server cannot reach, saying why. */
  render(clusters: ICluster[], unreachable: IUnreachable[] = []): void {
    const ids = new Set(clusters.map(c => c.id));
    for (const [id, item] of this._items) {
      if (!ids.has(id)) {
        item.remove();
        this._items.delete(id);
      }
    }
    for (const cluster of clusters) {
      let item = this._items.get(cluster.id);
      if (!item) {
        item = this._makeItem(cluster.id);
        this._items.set(cluster.id, item);
      }
      this._list.appendChild(item); // keeps the server's order (oldest first)
      this._fill(item, cluster);
    }
    this._empty.hidden = clusters.length + unreachable.length > 0;
    this._unreachable.replaceChildren(
      ...unreachable.map(c => {
        const line = el('li', 'monarch-unreachable-item', `${clusterName(c)}: not shown: ${c.why}`);
        line.title = `${c.scheduler_address} (controller pid ${c.pid})`;
        return line;
      })
    );
    let selected = this._selected;
    if (selected === null || !ids.has(selected)) {
      selected = clusters.length > 0 ? clusters[clusters.length - 1].id : null;
    }
    this._select(selected);
  }

  private _makeItem(id: string): HTMLLIElement {
    const item = el('li', 'monarch-cluster');
    item.dataset.id = id;
    item.tabIndex = 0;
    item.append(
      el('div', 'monarch-cluster-title'),
      el('div', 'monarch-cluster-address'),
      el('div', 'monarch-cluster-meta')
    );
    item.addEventListener('keydown', (event: KeyboardEvent) => {
      if (event.key === 'Enter' || event.key === ' ') {
        this._select(id);
      }
    });
    return item;
  }

  private _fill(item: HTMLElement, c: ICluster): void {
    const [title, address, meta] = Array.from(item.children) as HTMLElement[];
    title.textContent = clusterName(c);
    title.title = c.kernel_id ? `kernel ${c.kernel_id}` : `controller pid ${c.pid}`;
    address.textContent = c.scheduler_address;
    const ranks = `${c.ranks} rank${c.ranks === 1 ? '' : 's'}`;
    meta.textContent = `${ranks} · up ${formatSince(c.started)}`;
    meta.title = `since ${new Date(c.started * 1000).toLocaleString()}`;
  }

  private _select(id: string | null): void {
    for (const [key, item] of this._items) {
      item.classList.toggle('jp-mod-selected', key === id);
    }
    if (id !== this._selected) {
      this._selected = id;
      this._selectionChanged.emit(id);
    }
  }

  private _onClick = (event: MouseEvent): void => {
    const item = (event.target as HTMLElement).closest('li.monarch-cluster') as HTMLElement;
    if (item?.dataset.id) {
      this._select(item.dataset.id);
    }
  };

  private _empty: HTMLElement;
  private _list: HTMLUListElement;
  private _unreachable: HTMLUListElement;
  private _items = new Map<string, HTMLLIElement>();
  private _selected: string | null = null;
  private _selectionChanged = new Signal<this, string | null>(this);
}

/** Whose cluster it is: its notebook, else its kernel, else its controller's process. */
function clusterName(c: ICluster): string {
  if (c.notebook) {
    return c.notebook;
  }
  return c.kernel_id ? `kernel ${c.kernel_id.slice(0, 8)}` : `process ${c.pid}`;
}
