import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** The server's answer; `status` lets callers tell "gone" (410) from "up". */
export interface IReply<T> {
  status: number;
  data: T;
}

/**
 * Call the monarch server extension at /monarch/api/<endPoint>.
 *
 * Statuses in `accept` (besides 2xx) are returned, not thrown: the metrics route answers 410
 * with a JSON body when a cluster's scheduler is gone.
 */
export async function requestAPI<T>(
  endPoint: string,
  init: RequestInit = {},
  accept: number[] = []
): Promise<IReply<T>> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'monarch/api', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: any = null;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      throw new ServerConnection.ResponseError(response, `not JSON: ${text.slice(0, 80)}`);
    }
  }
  if (!response.ok && !accept.includes(response.status)) {
    throw new ServerConnection.ResponseError(response, data?.message ?? response.statusText);
  }
  return { status: response.status, data: data as T };
}

/** The URL of a page of a cluster's dashboard, through the server's proxy. */
export function proxyURL(clusterId: string, path: string): string {
  const settings = ServerConnection.makeSettings();
  return URLExt.join(settings.baseUrl, 'monarch/proxy', clusterId, path);
}
