import { ISignal, Signal } from '@lumino/signaling';
import { PanelLayout, Widget } from '@lumino/widgets';

import { BarChart } from './barChart';
import { el } from './format';
import { GROUP_RANKS, HostGroups } from './hostGroups';
import { LossChart } from './lossChart';
import { ParticipantsChart, stepRange } from './participantsChart';
import { RankTable } from './rankTable';
import { ICluster, IMetrics } from './types';

export type DetailAction = 'dashboard' | 'shutdown';

/** The selected cluster: its GPUs, its loss (and on a cluster started with --ft, the
 * participants per step under it), its ranks and the two actions. */
export class ClusterDetail extends Widget {
  constructor() {
    super();
    this.addClass('monarch-ClusterDetail');
    const layout = (this.layout = new PanelLayout());
    const header = new Widget({ node: el('div', 'monarch-detail-header') });
    this._title = el('div', 'monarch-detail-title');
    const actions = el('div', 'monarch-detail-actions');
    this._dashboard = this._button('Dashboard', 'Open the dashboard page in a tab', 'dashboard');
    this._shutdown = this._button('Shut down', 'Shut this cluster down', 'shutdown');
    actions.append(this._dashboard, this._shutdown);
    this._status = el('div', 'monarch-detail-status');
    header.node.append(this._title, actions, this._status);
    layout.addWidget(header);
    layout.addWidget(this._util);
    layout.addWidget(this._mem);
    layout.addWidget(this._loss);
    layout.addWidget(this._participants);
    layout.addWidget(this._ranks);
    layout.addWidget(this._hosts);
    this.showCluster(null);
  }

  get action(): ISignal<this, DetailAction> {
    return this._action;
  }

  get cluster(): ICluster | null {
    return this._cluster;
  }

  /** "loading", "up", "gone" or "error". */
  get state(): string {
    return this.node.dataset.state ?? 'loading';
  }

  showCluster(cluster: ICluster | null): void {
    this._cluster = cluster;
    this.node.hidden = cluster === null;
    if (cluster) {
      this._title.textContent = `Cluster ${cluster.id.slice(0, 8)}`;
      this._title.title = cluster.id;
      this._dashboard.disabled = !cluster.dashboard_url;
    }
  }

  /** Waiting for the first answer about this cluster. */
  loading(): void {
    this._setState('loading', 'Asking the scheduler…');
  }

  showMetrics(metrics: IMetrics): void {
    if (metrics.state === 'gone') {
      this._setState('gone', metrics.message ?? 'The scheduler is gone.');
      this._shutdown.textContent = 'Forget';
      this._shutdown.disabled = false;
      this._shutdown.title = 'Remove it from the list';
      this._dashboard.disabled = true;
      return;
    }
    this._shutdown.textContent = 'Shut down';
    // a joined cluster is shut down where it was started, not from here
    const joined = this._cluster?.owns_cluster === false;
    this._shutdown.disabled = joined;
    this._shutdown.title = joined
      ? 'Joined with %monarch connect: shut it down where it was started'
      : 'Shut this cluster down';
    this._dashboard.disabled = !this._cluster?.dashboard_url;
    const n = metrics.ranks.length;
    this._setState('up', `${n} rank${n === 1 ? '' : 's'} up`);
    // many ranks: grouped by host instead of a bar and a row per rank
    const grouped = n >= GROUP_RANKS;
    for (const part of [this._util, this._mem, this._ranks]) {
      part.setHidden(grouped);
      if (!grouped) {
        part.render(metrics.ranks);
      }
    }
    this._hosts.setHidden(!grouped);
    if (grouped) {
      this._hosts.render(metrics.ranks);
    }
    const ft = metrics.ft ?? null;
    const steps = ft ? stepRange(metrics.loss.map(s => s.steps), ft) : null;
    this._loss.render(metrics.loss, steps, ft?.lost ?? []);
    this._participants.render(ft, steps);
  }

  error(message: string): void {
    this._setState('error', message);
  }

  private _setState(state: string, text: string): void {
    this.node.dataset.state = state;
    this._status.textContent = text;
    this._status.className = `monarch-detail-status monarch-status-${state}`;
  }

  private _button(label: string, title: string, action: DetailAction): HTMLButtonElement {
    const variant = action === 'shutdown' ? 'jp-mod-warn' : 'jp-mod-accept';
    const button = el(
      'button',
      `jp-mod-styled ${variant} monarch-button monarch-button-${action}`,
      label
    );
    button.title = title;
    button.addEventListener('click', () => this._action.emit(action));
    return button;
  }

  private _cluster: ICluster | null = null;
  private _title: HTMLElement;
  private _status: HTMLElement;
  private _dashboard: HTMLButtonElement;
  private _shutdown: HTMLButtonElement;
  private _util = new BarChart('util');
  private _mem = new BarChart('mem');
  private _loss = new LossChart();
  private _participants = new ParticipantsChart();
  private _ranks = new RankTable();
  private _hosts = new HostGroups();
  private _action = new Signal<this, DetailAction>(this);
}
