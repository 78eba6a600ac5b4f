import { JupyterFrontEnd } from '@jupyterlab/application';
import { IFrame, MainAreaWidget } from '@jupyterlab/apputils';

import { proxyURL } from './request';
import { ICluster } from './types';

const open = new Map<string, MainAreaWidget<IFrame>>();

/** The cluster's /monarch page (bokeh figures served by its scheduler), through the server's
 * proxy, in a main-area tab; one tab per cluster. */
export function openDashboard(app: JupyterFrontEnd, cluster: ICluster): MainAreaWidget<IFrame> {
  const existing = open.get(cluster.id);
  if (existing && !existing.isDisposed) {
    app.shell.activateById(existing.id);
    return existing;
  }
  // the page runs bokeh's scripts and fetches its data from the same origin
  const frame = new IFrame({ sandbox: ['allow-scripts', 'allow-same-origin'] });
  frame.url = proxyURL(cluster.id, 'monarch');
  const widget = new MainAreaWidget({ content: frame });
  widget.id = `monarch-dashboard-${cluster.id}`;
  widget.title.label = `Monarch ${cluster.id.slice(0, 8)}`;
  widget.title.caption = `${cluster.scheduler_address} dashboard`;
  widget.title.closable = true;
  widget.disposed.connect(() => open.delete(cluster.id));
  open.set(cluster.id, widget);
  app.shell.add(widget, 'main');
  app.shell.activateById(widget.id);
  return widget;
}

/** Close the tab of a cluster that is gone or shut down. */
export function closeDashboard(clusterId: string): void {
  open.get(clusterId)?.dispose();
}
