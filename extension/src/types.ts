/** The shapes of the server extension's JSON (monarch_nb/server.py, monarch_nb/figures.py). */

/** One registered cluster: GET /monarch/api/clusters. */
export interface ICluster {
  id: string;
  scheduler_address: string;
  dashboard_url: string | null;
  ranks: number;
  /** Seconds since the epoch. */
  started: number;
  pid: number;
  kernel_id: string | null;
  notebook: string | null;
  /** False where the notebook joined the cluster (%monarch connect) rather than started it. */
  owns_cluster?: boolean;
}

/** A live cluster the server cannot show (its dashboard does not answer it), and why. */
export interface IUnreachable extends ICluster {
  why: string;
}

/** GET /monarch/api/clusters: what the sidebar lists, and what it leaves out and why. */
export interface IClusters {
  clusters: ICluster[];
  unreachable?: IUnreachable[];
}

/** One rank as the scheduler and the telemetry see it. */
export interface IRankRow {
  rank: number | string;
  worker: string | null;
  host: string | null;
  status: string;
  device: string | null;
  kind: string | null;
  /** Percent: the GPU's utilization, or the worker's CPU when `util_of` is "cpu". */
  util: number | null;
  util_of: 'gpu' | 'cpu';
  mem_used: number | null;
  mem_total: number | null;
  step: number | null;
  loss: number | null;
  /** The rank's mesh coordinates and monarch_nb.label()s: "dp=1 tp=0 stage=embed". */
  labels?: string;
}

export interface ILossSeries {
  rank: number | string;
  steps: number[];
  values: number[];
}

/** A rank of a fault-tolerant cell lost, joining (its replacement runs the setup cells),
 * healing (from a live peer) or back (monarch_nb/telemetry/ft_feed.py). */
export interface IFtEvent {
  time: number | null;
  rank: number;
  event: 'lost' | 'joining' | 'healing' | 'back';
  step: number | null;
  participants: number | null;
}

/** A cluster started with --ft: what its notebook's live panel last published. */
export interface IFt {
  world: number;
  /** [step, participants] where the participants changed, and the last step. */
  participants: [number, number][];
  /** [step, rank] of each rank lost. */
  lost: [number, number][];
  events: IFtEvent[];
  /** The ranks out of the running cell now; their rows' status says the same. */
  away: { rank: number; state: string; step: number | null }[];
  back: { rank: number; step: number | null }[];
}

/** GET /monarch/api/clusters/<id>/metrics; "gone" (HTTP 410) when the scheduler is dead. */
export interface IMetrics {
  id: string;
  state: 'up' | 'gone';
  message?: string;
  time?: number;
  ranks: IRankRow[];
  loss: ILossSeries[];
  /** Only on a cluster started with --ft, once a fault-tolerant cell's panel published. */
  ft?: IFt;
}

export const PALETTE = [
  '#1f77b4',
  '#ff7f0e',
  '#2ca02c',
  '#d62728',
  '#9467bd',
  '#8c564b',
  '#e377c2',
  '#7f7f7f',
  '#bcbd22',
  '#17becf'
];

/** The same colour per rank as the bokeh figures (monarch_nb/figures.py). */
export function rankColor(rank: number | string): string {
  return typeof rank === 'number'
    ? PALETTE[rank % PALETTE.length]
    : PALETTE[PALETTE.length - 1];
}

export function rankName(rank: number | string): string {
  return typeof rank === 'number' ? `rank ${rank}` : String(rank);
}

/** One kept cluster (%monarch up --keep): GET /monarch/api/kept. */
export interface IKept {
  id: string;
  name: string;
  owner: string;
  state: 'attached' | 'detached';
  ranks: number;
  devices: string;
  /** Seconds since the epoch. */
  started: number;
  detached_since: number | null;
  /** Seconds without a kernel after which it shuts itself down. */
  idle_limit: number;
  holder: { kernel: string | null; notebook: string | null; since: number } | null;
}
