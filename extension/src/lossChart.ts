import { Widget } from '@lumino/widgets';

import { el, formatNumber } from './format';
import { ILossSeries, rankColor, rankName } from './types';

export const SVG = 'http://www.w3.org/2000/svg';
export const W = 300; // the chart's own coordinates; the SVG scales to the sidebar's width
const H = 120;
export const PAD = 4;
const LEGEND_RANKS = 16;

/** The steps from `lo` to `hi` drawn across a chart `W` wide (the participants chart below
 * the loss shares them). */
export function stepScale(lo: number, hi: number): (x: number) => number {
  const x1 = hi > lo ? hi : lo + 1;
  return (x: number) => PAD + ((x - lo) / (x1 - lo)) * (W - 2 * PAD);
}

/** The loss against the step, one line per rank, with the ranges on the axes; on a cluster
 * started with --ft, a dashed mark at each step where a rank was lost. */
export class LossChart extends Widget {
  constructor() {
    super();
    this.addClass('monarch-LossChart');
    this._svg = document.createElementNS(SVG, 'svg');
    this._svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
    this._svg.setAttribute('preserveAspectRatio', 'none');
    this._svg.classList.add('monarch-loss-plot');
    this._svg.appendChild(this._marks); // under the lines
    this._empty = el('p', 'monarch-empty', 'No loss yet: call monarch_nb.log(loss=...) in a cell.');
    this._yRange = el('div', 'monarch-loss-yrange');
    this._xRange = el('div', 'monarch-loss-xrange');
    this._legend = el('div', 'monarch-loss-legend');
    const plot = el('div', 'monarch-loss-frame');
    plot.append(this._yRange, this._svg);
    const title = el('h3', 'monarch-chart-title', 'Loss');
    this.node.append(title, this._empty, plot, this._xRange, this._legend);
  }

  /** `steps`: the x range to draw (shared with the participants chart), else the loss's own;
   * `lost`: [step, rank] of each rank lost. */
  render(
    series: ILossSeries[],
    steps: [number, number] | null = null,
    lost: [number, number][] = []
  ): void {
    const shown = series.filter(s => s.steps.length > 0);
    this._empty.hidden = shown.length > 0;
    this.node.classList.toggle('monarch-mod-empty', shown.length === 0);
    let x0 = Infinity;
    let x1 = -Infinity;
    let y0 = Infinity;
    let y1 = -Infinity;
    for (const s of shown) {
      s.steps.forEach((x, i) => {
        const y = s.values[i];
        if (Number.isFinite(y)) {
          x0 = Math.min(x0, x);
          x1 = Math.max(x1, x);
          y0 = Math.min(y0, y);
          y1 = Math.max(y1, y);
        }
      });
    }
    if (steps) {
      [x0, x1] = steps;
    }
    if (x1 <= x0) {
      x1 = x0 + 1;
    }
    if (y1 <= y0) {
      y1 = y0 + 1;
    }
    const sx = stepScale(x0, x1);
    const sy = (y: number) => H - PAD - ((y - y0) / (y1 - y0)) * (H - 2 * PAD);
    const keys = new Set(shown.map(s => String(s.rank)));
    for (const [key, line] of this._lines) {
      if (!keys.has(key)) {
        line.remove();
        this._lines.delete(key);
      }
    }
    this._legend.textContent = '';
    // past a screenful of names, a line says its rank on hover instead
    this._legend.hidden = shown.length >= LEGEND_RANKS;
    for (const s of shown) {
      const key = String(s.rank);
      let line = this._lines.get(key);
      if (!line) {
        line = document.createElementNS(SVG, 'polyline');
        line.classList.add('monarch-loss-line');
        line.dataset.rank = key;
        line.setAttribute('fill', 'none');
        line.setAttribute('stroke-width', '2');
        line.setAttribute('vector-effect', 'non-scaling-stroke');
        const title = document.createElementNS(SVG, 'title'); // which rank, on hover
        title.textContent = rankName(s.rank);
        line.appendChild(title);
        this._svg.appendChild(line);
        this._lines.set(key, line);
      }
      const points = s.steps
        .map((x, i) => [x, s.values[i]])
        .filter(([, y]) => Number.isFinite(y))
        .map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`);
      line.setAttribute('points', points.join(' '));
      line.setAttribute('stroke', rankColor(s.rank));
      const item = el('span', 'monarch-legend-item', rankName(s.rank));
      item.style.setProperty('--monarch-rank-color', rankColor(s.rank));
      this._legend.appendChild(item);
    }
    this._marks.replaceChildren();
    for (const [step, rank] of shown.length > 0 ? lost : []) {
      if (step < x0 || step > x1) {
        continue;
      }
      const mark = document.createElementNS(SVG, 'line');
      mark.classList.add('monarch-ft-mark');
      const x = sx(step).toFixed(1);
      for (const [name, value] of [['x1', x], ['x2', x], ['y1', '0'], ['y2', String(H)]]) {
        mark.setAttribute(name, value);
      }
      mark.setAttribute('vector-effect', 'non-scaling-stroke');
      const title = document.createElementNS(SVG, 'title');
      title.textContent = `rank ${rank} lost at step ${step}`;
      mark.appendChild(title);
      this._marks.appendChild(mark);
    }
    if (shown.length > 0) {
      const top = el('span', '', formatNumber(y1));
      this._yRange.replaceChildren(top, el('span', '', formatNumber(y0)));
      this._xRange.textContent = `step ${formatNumber(x0)} … ${formatNumber(x1)}`;
    } else {
      this._yRange.replaceChildren();
      this._xRange.textContent = '';
    }
  }

  private _svg: SVGSVGElement;
  private _empty: HTMLElement;
  private _yRange: HTMLElement;
  private _xRange: HTMLElement;
  private _legend: HTMLElement;
  private _lines = new Map<string, SVGPolylineElement>();
  private _marks = document.createElementNS(SVG, 'g');
}
