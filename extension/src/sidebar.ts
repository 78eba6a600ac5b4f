import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import { Message } from '@lumino/messaging';
import { Panel } from '@lumino/widgets';

import { ClusterDetail, DetailAction } from './clusterDetail';
import { ClusterList } from './clusterList';
import { closeDashboard } from './dashboardTab';
import { KeptList } from './keptList';
import { Poller } from './poller';
import { requestAPI } from './request';
import { ICluster, IClusters, IKept, IMetrics } from './types';

export interface ISidebarOptions {
  interval: number;
  maxInterval: number;
  openDashboard: (cluster: ICluster) => void;
}

/** The "Monarch" sidebar: the clusters of this server's kernels and the selected one's state.
 * It polls the server (never a kernel) only while it is visible. */
export class MonarchSidebar extends Panel {
  constructor(options: ISidebarOptions) {
    super();
    this.id = 'monarch-sidebar';
    this.addClass('monarch-Sidebar');
    this.title.caption = 'Monarch clusters';
    this._openDashboard = options.openDashboard;
    this.addWidget(this._list);
    this.addWidget(this._kept);
    this.addWidget(this._detail);
    this._listPoll = new Poller(this._pollList, options.interval, options.maxInterval);
    this._metricsPoll = new Poller(this._pollMetrics, options.interval, options.maxInterval);
    this._list.selectionChanged.connect(this._onSelect, this);
    this._detail.action.connect(this._onAction, this);
    this._kept.shutDown.connect(this._onShutDownKept, this);
  }

  setIntervals(interval: number, maxInterval: number): void {
    this._listPoll.setIntervals(interval, maxInterval);
    this._metricsPoll.setIntervals(interval, maxInterval);
  }

  refresh(): void {
    this._listPoll.refresh();
    this._metricsPoll.refresh();
  }

  dispose(): void {
    this._listPoll.dispose();
    this._metricsPoll.dispose();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._listPoll.start();
    this._metricsPoll.start();
    this.refresh();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this._listPoll.start();
      this._metricsPoll.start();
    }
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._listPoll.stop();
    this._metricsPoll.stop();
  }

  private _pollList = async (): Promise<boolean> => {
    const [{ data }, kept] = await Promise.all([
      requestAPI<IClusters>('clusters'),
      // the kept clusters are an addition: the list of clusters shows without them
      requestAPI<{ kept: IKept[] }>('kept').catch(() => ({ status: 0, data: { kept: [] } }))
    ]);
    const unreachable = data.unreachable ?? [];
    this._kept.render(kept.data.kept);
    const text = JSON.stringify([
      data.clusters,
      unreachable,
      kept.data.kept.map(k => [k.id, k.state])
    ]);
    const changed = text !== this._listText;
    this._listText = text;
    this._clusters = new Map(data.clusters.map(c => [c.id, c]));
    this._list.render(data.clusters, unreachable); // also refreshes the "up since" times
    const selected = this._list.selected;
    if (selected !== this._detail.cluster?.id) {
      this._onSelect(this._list, selected);
    }
    return changed;
  };

  private _pollMetrics = async (): Promise<boolean> => {
    const cluster = this._detail.cluster;
    if (!cluster) {
      return false;
    }
    try {
      const { data } = await requestAPI<IMetrics>(`clusters/${cluster.id}/metrics`, {}, [410]);
      if (this._detail.cluster?.id !== cluster.id) {
        return true; // the selection moved while we waited
      }
      const { time, ...rest } = data;
      const text = JSON.stringify(rest);
      const changed = text !== this._metricsText;
      this._metricsText = text;
      this._detail.showMetrics(data);
      return changed;
    } catch (error) {
      if (error instanceof ServerConnection.ResponseError && error.response.status === 404) {
        this._listPoll.refresh(); // it vanished: the list will drop it
        return true;
      }
      this._detail.error(error instanceof Error ? error.message : String(error));
      throw error;
    }
  };

  private _onSelect(_: ClusterList, id: string | null): void {
    this._detail.showCluster(id === null ? null : this._clusters.get(id) ?? null);
    this._metricsText = '';
    if (id !== null) {
      this._detail.loading();
      this._metricsPoll.refresh();
    }
  }

  private async _onAction(_: ClusterDetail, action: DetailAction): Promise<void> {
    const cluster = this._detail.cluster;
    if (!cluster) {
      return;
    }
    if (action === 'dashboard') {
      this._openDashboard(cluster);
      return;
    }
    const gone = this._detail.state === 'gone';
    const result = await showDialog({
      title: gone ? 'Forget the cluster?' : 'Shut the cluster down?',
      body: gone
        ? `The scheduler at ${cluster.scheduler_address} does not answer. Remove it from the list?`
        : `The scheduler at ${cluster.scheduler_address} and its ${cluster.ranks} workers will ` +
          'stop; anything running on them is lost. The notebook that started it will need a ' +
          'new %monarch up.',
      buttons: [
        Dialog.cancelButton(),
        Dialog.warnButton({ label: gone ? 'Forget' : 'Shut down' })
      ]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      const forget = gone ? '?forget=1' : '';
      await requestAPI(`clusters/${cluster.id}${forget}`, { method: 'DELETE' }, [404]);
      closeDashboard(cluster.id);
    } catch (error) {
      await showErrorMessage('Could not shut the cluster down', error as Error);
    }
    this._listPoll.refresh();
  }

  private async _onShutDownKept(_: KeptList, kept: IKept): Promise<void> {
    const result = await showDialog({
      title: `Shut ${kept.name} down?`,
      body:
        `Kept cluster ${kept.name} and its ${kept.ranks} workers will stop; every rank's ` +
        'namespace and actors are lost.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Shut down' })]
    });
    if (!result.button.accept) {
      return;
    }
    try {
      await requestAPI(`kept/${kept.id}`, { method: 'DELETE' }, [404]);
    } catch (error) {
      await showErrorMessage('Could not shut the cluster down', error as Error);
    }
    this._listPoll.refresh();
  }

  private _list = new ClusterList();
  private _kept = new KeptList();
  private _detail = new ClusterDetail();
  private _clusters = new Map<string, ICluster>();
  private _listPoll: Poller;
  private _metricsPoll: Poller;
  private _listText = '';
  private _metricsText = '';
  private _openDashboard: (cluster: ICluster) => void;
}
