import { Widget } from '@lumino/widgets';

import { el } from './format';
import { stepScale, SVG, W } from './lossChart';
import { IFt, IFtEvent } from './types';

const H = 40;
const EVENTS_SHOWN = 4; // a loss's four: lost, joining, healing, back

/** The steps the loss chart and this one share: the loss's and the participants'. */
export function stepRange(lossSteps: number[][], ft: IFt): [number, number] | null {
  let lo = Infinity;
  let hi = -Infinity;
  for (const steps of [...lossSteps, ft.participants.map(p => p[0])]) {
    for (const x of steps) {
      lo = Math.min(lo, x);
      hi = Math.max(hi, x);
    }
  }
  return Number.isFinite(lo) ? [lo, hi > lo ? hi : lo + 1] : null;
}

export function describe(e: IFtEvent, world: number): string {
  const n = e.participants;
  switch (e.event) {
    case 'lost':
      return `rank ${e.rank} lost at step ${e.step}` + (n ? `; ${n} of ${world} go on` : '');
    case 'joining':
      return `rank ${e.rank} joining: its replacement runs the setup cells`;
    case 'healing':
      return `rank ${e.rank} healing from a peer at step ${e.step}`;
    default:
      return `rank ${e.rank} back at step ${e.step}` + (n ? `; ${n} of ${world} train` : '');
  }
}

/** Under the loss on a cluster started with --ft: the participants per step (0 to the world
 * size, on the loss chart's steps; the steps taken with fewer shaded) and the newest events. */
export class ParticipantsChart extends Widget {
  constructor() {
    super();
    this.addClass('monarch-ParticipantsChart');
    this._svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
    this._svg.setAttribute('preserveAspectRatio', 'none');
    this._svg.classList.add('monarch-ft-plot');
    this._line.classList.add('monarch-ft-line');
    this._line.setAttribute('fill', 'none');
    this._line.setAttribute('vector-effect', 'non-scaling-stroke');
    this._svg.append(this._fewer, this._line);
    const frame = el('div', 'monarch-loss-frame');
    frame.append(this._yRange, this._svg);
    const title = el('h3', 'monarch-chart-title', 'Participants per step');
    this.node.append(title, this._latest, frame, this._events);
    this._latest.className = 'monarch-ft-latest';
    this._events.className = 'monarch-ft-events';
  }

  /** Hidden without `ft` (a cluster without --ft); `steps` is the loss chart's x range. */
  render(ft: IFt | null, steps: [number, number] | null): void {
    this.setHidden(ft === null);
    if (ft === null) {
      return;
    }
    const world = Math.max(ft.world, 1);
    const points = ft.participants;
    this._yRange.replaceChildren(el('span', '', String(world)), el('span', '', '0'));
    this._fewer.replaceChildren();
    if (points.length === 0 || steps === null) {
      this._line.setAttribute('points', '');
      this._latest.textContent = 'No ft.steps loop yet.';
    } else {
      const sx = stepScale(steps[0], steps[1]);
      const sy = (n: number) => H - (Math.min(Math.max(n, 0), world) / world) * (H - 2) - 1;
      const coords: string[] = [];
      points.forEach(([step, n], i) => {
        if (i > 0) {
          coords.push(`${sx(step).toFixed(1)},${sy(points[i - 1][1]).toFixed(1)}`);
        }
        coords.push(`${sx(step).toFixed(1)},${sy(n).toFixed(1)}`);
        const next = points[i + 1];
        if (next && n < world) {
          const shade = document.createElementNS(SVG, 'rect');
          shade.classList.add('monarch-ft-fewer');
          shade.setAttribute('x', sx(step).toFixed(1));
          shade.setAttribute('width', Math.max(sx(next[0]) - sx(step), 1).toFixed(1));
          shade.setAttribute('y', '0');
          shade.setAttribute('height', String(H));
          this._fewer.appendChild(shade);
        }
      });
      this._line.setAttribute('points', coords.join(' '));
      const [step, n] = points[points.length - 1];
      this._latest.textContent = `${n} of ${ft.world} at step ${step}`;
    }
    this._events.replaceChildren(
      ...ft.events.slice(-EVENTS_SHOWN).map(e => {
        const line = el('div', `monarch-ft-event monarch-ft-${e.event}`, describe(e, ft.world));
        line.dataset.rank = String(e.rank);
        return line;
      })
    );
  }

  private _svg = document.createElementNS(SVG, 'svg');
  private _fewer = document.createElementNS(SVG, 'g');
  private _line = document.createElementNS(SVG, 'polyline');
  private _yRange = el('div', 'monarch-loss-yrange');
  private _latest = el('div');
  private _events = el('div');
}
