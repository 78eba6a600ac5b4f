import { Widget } from '@lumino/widgets';

import { compactRanks, el, formatBytes, formatNumber } from './format';
import { IRankRow, rankColor, rankName } from './types';

/** From this many ranks the sidebar groups them by host (the notebook's panel turns compact
 * there too); under it, a bar per GPU and a row per rank as before. */
export const GROUP_RANKS = 16;

interface IHost {
  node: HTMLDetailsElement;
  summary: HTMLElement;
  body: HTMLTableSectionElement;
  rows: IRankRow[];
}

/** The ranks by host: a summary line per host (its ranks, their mean utilization and the
 * lowest, memory in use, states, the loss's median) that opens into a row per GPU. Hosts
 * change in place; a host's GPU rows are drawn only while it is open, so 64 ranks on 8 hosts
 * are 8 lines to lay out until one is opened. */
export class HostGroups extends Widget {
  constructor() {
    super();
    this.addClass('monarch-HostGroups');
    this.node.append(el('h3', 'monarch-chart-title', 'Hosts'));
  }

  render(rows: IRankRow[]): void {
    const started = performance.now();
    const byHost = new Map<string, IRankRow[]>();
    for (const row of rows) {
      const host = row.host ?? '?';
      const list = byHost.get(host) ?? [];
      list.push(row);
      byHost.set(host, list);
    }
    for (const [name, host] of this._hosts) {
      if (!byHost.has(name)) {
        host.node.remove();
        this._hosts.delete(name);
      }
    }
    for (const [name, members] of byHost) {
      let host = this._hosts.get(name);
      if (!host) {
        host = this._makeHost(name);
        this._hosts.set(name, host);
      }
      this.node.appendChild(host.node); // in the order of their first rank
      host.rows = members;
      this._summarize(host, name);
      if (host.node.open) {
        this._fillRanks(host);
      }
    }
    // how long the last update took, for the browser test to report
    this.node.dataset.renderMs = (performance.now() - started).toFixed(2);
  }

  private _makeHost(name: string): IHost {
    const node = document.createElement('details');
    node.className = 'monarch-host';
    node.dataset.host = name;
    const summary = el('summary', 'monarch-host-summary');
    const table = el('table', 'monarch-rank-table monarch-host-ranks');
    const head = el('tr');
    for (const title of ['rank', 'util', 'memory', 'state', 'loss']) {
      head.appendChild(el('th', '', title));
    }
    table.createTHead().appendChild(head);
    const body = table.createTBody();
    node.append(summary, table);
    const host: IHost = { node, summary, body, rows: [] };
    // opened: its rows now; closed: none kept to update
    node.addEventListener('toggle', () => {
      if (node.open) {
        this._fillRanks(host);
      } else {
        body.replaceChildren();
      }
    });
    return host;
  }

  private _summarize(host: IHost, name: string): void {
    const rows = host.rows;
    const ranks = rows.map(r => r.rank).filter((r): r is number => typeof r === 'number');
    const util = rows.filter(r => r.util !== null);
    const what = rows.some(r => r.util_of === 'gpu') ? 'GPU' : 'CPU';
    let utilText = `${what} -`;
    let mean = 0;
    if (util.length) {
      mean = util.reduce((a, r) => a + (r.util as number), 0) / util.length;
      const low = util.reduce((a, r) => ((r.util as number) < (a.util as number) ? r : a));
      const lowest = `${rankName(low.rank)} ${(low.util as number).toFixed(0)}%`;
      utilText = `${what} ${mean.toFixed(0)}%, lowest ${lowest}`;
    }
    const used = rows.reduce((a, r) => a + (r.mem_used ?? 0), 0);
    // GPUs' memory adds up; CPU ranks each report the host's, which they share
    const gpus = rows.every(r => r.util_of === 'gpu');
    const total = gpus ? rows.reduce((a, r) => a + (r.mem_total ?? 0), 0) : 0;
    const devices = new Set(rows.map(r => r.device ?? r.kind).filter(Boolean));
    const states = new Map<string, number>();
    for (const r of rows) {
      states.set(r.status, (states.get(r.status) ?? 0) + 1);
    }
    const losses = rows
      .map(r => r.loss)
      .filter((v): v is number => v !== null && Number.isFinite(v));
    const parts = [
      `${rows.length} rank${rows.length === 1 ? '' : 's'} ${compactRanks(ranks)}`,
      [...states].map(([s, n]) => `${n} ${s}`).join(', '),
      devices.size === 1 ? `${[...devices][0]}` : '',
      total ? `${formatBytes(used)} / ${formatBytes(total)}` : `${formatBytes(used)} in use`,
      losses.length ? `loss median ${formatNumber(median(losses))}` : ''
    ].filter(Boolean);
    const title = el('span', 'monarch-host-name', name);
    const bar = el('span', 'monarch-host-util');
    const fill = el('span', 'monarch-host-util-fill');
    fill.style.width = `${Math.max(0, Math.min(100, mean))}%`;
    bar.appendChild(fill);
    bar.title = utilText;
    host.summary.replaceChildren(
      title,
      bar,
      el('span', 'monarch-host-util-text', utilText),
      el('div', 'monarch-host-meta', parts.join(' · '))
    );
    host.summary.title = `${name}: ${parts.join(' · ')}`;
  }

  private _fillRanks(host: IHost): void {
    const body = host.body;
    const rows = host.rows;
    while (body.rows.length > rows.length) {
      body.deleteRow(-1);
    }
    while (body.rows.length < rows.length) {
      const tr = body.insertRow();
      for (let i = 0; i < 5; i++) {
        tr.insertCell();
      }
    }
    rows.forEach((row, i) => {
      const tr = body.rows[i];
      tr.dataset.rank = String(row.rank);
      const cells = tr.cells;
      cells[0].textContent = String(row.rank);
      cells[0].style.color = rankColor(row.rank);
      if (row.labels) {
        cells[0].appendChild(el('div', 'monarch-rank-labels', row.labels));
      }
      cells[1].textContent = row.util === null ? '-' : `${row.util.toFixed(0)}%`;
      cells[2].textContent = formatBytes(row.mem_used);
      cells[3].textContent = row.status;
      cells[3].className = `monarch-state monarch-state-${row.status}`;
      cells[4].textContent = formatNumber(row.loss);
      const device = row.device ?? row.kind ?? 'no telemetry yet';
      const step = row.step === null ? '' : `, step ${row.step}`;
      tr.title = `${rankName(row.rank)}: ${device}, ${formatBytes(row.mem_used)} of ${formatBytes(
        row.mem_total
      )}${step}`;
    });
  }

  private _hosts = new Map<string, IHost>();
}

function median(values: number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
}
