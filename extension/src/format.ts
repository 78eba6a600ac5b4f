/** Small text formatters shared by the components. */

export function formatBytes(n: number | null): string {
  if (n === null || n === undefined) {
    return '-';
  }
  const gib = n / 2 ** 30;
  return gib >= 1 ? `${gib.toFixed(1)} GiB` : `${(n / 2 ** 20).toFixed(0)} MiB`;
}

/** "3 min", "2 h 5 min": how long ago `epochSeconds` was. */
export function formatSince(epochSeconds: number, now: number = Date.now()): string {
  const s = Math.max(0, Math.round(now / 1000 - epochSeconds));
  if (s < 60) {
    return `${s} s`;
  }
  const m = Math.floor(s / 60);
  if (m < 60) {
    return `${m} min`;
  }
  const h = Math.floor(m / 60);
  return `${h} h ${m % 60} min`;
}

export function formatNumber(v: number | null): string {
  if (v === null || v === undefined || !Number.isFinite(v)) {
    return '-';
  }
  const a = Math.abs(v);
  return a !== 0 && (a < 1e-3 || a >= 1e5) ? v.toExponential(2) : String(+v.toPrecision(4));
}

export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

/** Ranks as runs, as the notebook writes them: [0, 1, 2, 5] -> "0-2,5". */
export function compactRanks(ranks: number[]): string {
  const sorted = [...ranks].sort((a, b) => a - b);
  const runs: string[] = [];
  let i = 0;
  while (i < sorted.length) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) {
      j++;
    }
    runs.push(j > i ? `${sorted[i]}-${sorted[j]}` : String(sorted[i]));
    i = j + 1;
  }
  return runs.join(',');
}
