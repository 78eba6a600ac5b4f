import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { requestAPI } from './request';

/** What /monarch/api/bokeh lists: the installed bokeh's version and its files, in load order. */
interface IBokehFiles {
  version: string;
  files: string[];
}

declare global {
  interface Window {
    Bokeh?: { version?: string };
  }
}

async function fetchScript(name: string, settings: ServerConnection.ISettings): Promise<string> {
  const url = URLExt.join(settings.baseUrl, 'monarch/bokeh', name);
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, `${name}: ${response.statusText}`);
  }
  return response.text();
}

/**
 * Put the installed bokeh's BokehJS into the page, once.
 *
 * The files come through ServerConnection, so they carry the same credentials as every other
 * request of the page (a token in a header works where a script tag's cookie would not), and
 * run as inline scripts in order: BokehJS defines `window.Bokeh`, the bundles register on it.
 */
export async function loadBokeh(): Promise<string> {
  const { data } = await requestAPI<IBokehFiles>('bokeh');
  const present = window.Bokeh?.version;
  if (present !== undefined) {
    if (present !== data.version) {
      // BokehJS keeps the first copy as window.Bokeh; figures from this kernel's bokeh would
      // meet a different version, which is what the warning is for
      console.warn(
        `monarch: BokehJS ${present} was already in the page; the kernel's bokeh is ` +
          `${data.version}. Reload the page if figures do not draw.`
      );
    }
    return present;
  }
  const settings = ServerConnection.makeSettings();
  const sources = await Promise.all(data.files.map(name => fetchScript(name, settings)));
  sources.forEach((source, i) => {
    const script = document.createElement('script');
    script.dataset.monarchBokeh = data.files[i];
    script.textContent = source;
    document.head.appendChild(script); // an inline script runs as it is appended
  });
  if (window.Bokeh?.version !== data.version) {
    throw new Error(`the scripts ran but window.Bokeh is not version ${data.version}`);
  }
  return data.version;
}

/**
 * Loads BokehJS before the shell attaches: the application awaits every startup plugin's
 * activation, so no notebook output (a jupyter_bokeh widget restored after a page reload
 * included) renders before window.Bokeh exists. No ILabShell: Notebook 7 runs it too.
 */
export const bokehLoaderPlugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-nb:bokeh-loader',
  description: "Loads the installed bokeh's BokehJS into the page, without a CDN.",
  autoStart: true,
  activate: async (_app: JupyterFrontEnd) => {
    try {
      await loadBokeh();
    } catch (error) {
      console.error(
        'monarch: BokehJS could not be loaded from the Jupyter server (is the monarch_nb ' +
          'server extension enabled?); bokeh figures will not draw:',
        error
      );
    }
  }
};
