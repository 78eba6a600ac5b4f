import { Widget } from '@lumino/widgets';

import { el, formatBytes } from './format';
import { IRankRow, rankColor, rankName } from './types';

export type BarKind = 'util' | 'mem';

/** One horizontal bar per rank (GPU) for utilization or memory; bars change in place. */
export class BarChart extends Widget {
  constructor(kind: BarKind) {
    super();
    this._kind = kind;
    this.addClass('monarch-BarChart');
    this.addClass(`monarch-BarChart-${kind}`);
    this.node.append(el('h3', 'monarch-chart-title', kind === 'util' ? 'Utilization' : 'Memory'));
  }

  render(rows: IRankRow[]): void {
    const keys = new Set(rows.map(r => String(r.rank)));
    for (const [key, bar] of this._bars) {
      if (!keys.has(key)) {
        bar.remove();
        this._bars.delete(key);
      }
    }
    for (const row of rows) {
      const key = String(row.rank);
      let bar = this._bars.get(key);
      if (!bar) {
        bar = this._makeBar(key);
        this._bars.set(key, bar);
      }
      this.node.appendChild(bar);
      this._fill(bar, row);
    }
  }

  private _makeBar(key: string): HTMLElement {
    const bar = el('div', 'monarch-bar');
    bar.dataset.rank = key;
    const track = el('div', 'monarch-bar-track');
    track.append(el('div', 'monarch-bar-fill'), el('span', 'monarch-bar-value'));
    bar.append(el('div', 'monarch-bar-label'), track);
    return bar;
  }

  private _fill(bar: HTMLElement, row: IRankRow): void {
    const label = bar.querySelector('.monarch-bar-label') as HTMLElement;
    const fill = bar.querySelector('.monarch-bar-fill') as HTMLElement;
    const value = bar.querySelector('.monarch-bar-value') as HTMLElement;
    const device = row.device ?? row.kind ?? '';
    label.textContent = [rankName(row.rank), device, row.host ?? ''].filter(Boolean).join(' · ');
    let percent: number | null = null;
    let text = '-';
    if (this._kind === 'util') {
      const what = row.util_of === 'gpu' ? 'GPU' : 'CPU';
      if (row.util !== null) {
        percent = row.util;
        text = `${what} ${row.util.toFixed(0)}%`;
      } else {
        text = `${what} -`;
      }
    } else if (row.mem_used !== null && row.mem_total) {
      percent = (100 * row.mem_used) / row.mem_total;
      text = `${formatBytes(row.mem_used)} / ${formatBytes(row.mem_total)}`;
    }
    const width = percent === null ? 0 : Math.max(0, Math.min(100, percent));
    fill.style.width = `${width}%`;
    fill.style.backgroundColor = rankColor(row.rank);
    value.textContent = text;
    bar.dataset.value = percent === null ? '' : percent.toFixed(1);
    bar.title = `${label.textContent}: ${text}`;
  }

  private _kind: BarKind;
  private _bars = new Map<string, HTMLElement>();
}
