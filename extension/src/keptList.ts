import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { el, formatSince } from './format';
import { IKept } from './types';

/** The kept clusters (%monarch up --keep) that no kernel holds: "detached", with their owner,
 * age and idle time, each with a button to shut it down. Hidden while there are none; the
 * attached ones are in the cluster list, under their notebook. */
export class KeptList extends Widget {
  constructor() {
    super();
    this.addClass('monarch-KeptList');
    this.node.append(el('h3', 'monarch-kept-heading', 'Detached clusters'), this._list);
    this._list.className = 'monarch-kept-items';
    this._list.addEventListener('click', this._onClick);
    this.hide();
  }

  /** Asked for when a row's "Shut down" is pressed. */
  get shutDown(): ISignal<this, IKept> {
    return this._shutDown;
  }

  render(kept: IKept[]): void {
    const detached = kept.filter(k => k.state === 'detached');
    this._rows = new Map(detached.map(k => [k.id, k]));
    this._list.replaceChildren(...detached.map(k => this._item(k)));
    this.setHidden(detached.length === 0);
  }

  private _item(k: IKept): HTMLLIElement {
    const item = el('li', 'monarch-kept');
    item.dataset.id = k.id;
    const ranks = `${k.ranks} rank${k.ranks === 1 ? '' : 's'}`;
    const idle = k.detached_since === null ? '' : ` · idle ${formatSince(k.detached_since)}`;
    const button = el('button', 'jp-mod-styled jp-mod-warn monarch-kept-shutdown', 'Shut down');
    button.title = `stop ${k.name}'s host and its ${ranks}`;
    item.append(
      el('div', 'monarch-cluster-title', `${k.name} · detached`),
      el('div', 'monarch-cluster-meta', `${k.owner} · ${ranks} · ${k.devices}`),
      el('div', 'monarch-cluster-meta', `up ${formatSince(k.started)}${idle}`),
      button
    );
    item.title = `%monarch attach ${k.name} in a notebook takes it up again`;
    return item;
  }

  private _onClick = (event: MouseEvent): void => {
    const target = event.target as HTMLElement;
    const item = target.closest('li.monarch-kept') as HTMLElement | null;
    const row = item?.dataset.id ? this._rows.get(item.dataset.id) : undefined;
    if (row && target.closest('button.monarch-kept-shutdown')) {
      this._shutDown.emit(row);
    }
  };

  private _list = el('ul');
  private _rows = new Map<string, IKept>();
  private _shutDown = new Signal<this, IKept>(this);
}
