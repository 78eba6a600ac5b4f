/**
 * Calls `tick` now and again: every `interval` ms while the answers change, less and less often
 * (up to `maxInterval`) while they stay the same or fail, and at once on `refresh()`.
 */
export type Tick = () => Promise<boolean>;

export class Poller {
  constructor(tick: Tick, interval: number, maxInterval: number) {
    this._tick = tick;
    this.setIntervals(interval, maxInterval);
  }

  /** The delay before the next call, in ms (grows while nothing changes). */
  get delay(): number {
    return this._delay;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  setIntervals(interval: number, maxInterval: number): void {
    this._interval = Math.max(250, interval);
    this._max = Math.max(this._interval, maxInterval);
    this._delay = this._interval;
  }

  start(): void {
    if (!this._disposed && this._timer === null && !this._running) {
      this._schedule(0);
    }
  }

  /** Call `tick` as soon as the call in flight (if any) is done, and reset the backoff. */
  refresh(): void {
    this._delay = this._interval;
    if (this._running) {
      this._again = true;
      return;
    }
    this._clear();
    this._schedule(0);
  }

  stop(): void {
    this._clear();
  }

  dispose(): void {
    this._disposed = true;
    this._clear();
  }

  private _schedule(delay: number): void {
    this._timer = window.setTimeout(() => void this._run(), delay);
  }

  private _clear(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  private async _run(): Promise<void> {
    this._timer = null;
    this._running = true;
    let changed = false;
    let failed = false;
    try {
      changed = await this._tick();
    } catch (error) {
      failed = true;
      console.warn('monarch: polling failed', error);
    }
    this._running = false;
    if (this._disposed) {
      return;
    }
    if (this._again) {
      this._again = false;
      this._delay = this._interval;
      this._schedule(0);
      return;
    }
    if (changed && !failed) {
      this._delay = this._interval;
    } else {
      this._delay = Math.min(this._max, this._delay * (failed ? 2 : 1.5));
    }
    this._schedule(this._delay);
  }

  private _tick: Tick;
  private _interval = 2000;
  private _max = 15000;
  private _delay = 2000;
  private _timer: number | null = null;
  private _running = false;
  private _again = false;
  private _disposed = false;
}
