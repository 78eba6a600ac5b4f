import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { LabIcon } from '@jupyterlab/ui-components';

import { bokehLoaderPlugin } from './bokehLoader';
import { openDashboard } from './dashboardTab';
import { MonarchSidebar } from './sidebar';

const PLUGIN_ID = 'monarch-nb:plugin';

// a butterfly: two wings either side of the body
const WINGS =
  'M12 11c-1.5-4-4.5-7-8.5-7C2.5 4 2 5 2.3 6.2 3 9 4.5 11 7 12c-2 .8-3 2.5-3 4.3 ' +
  '0 1.5 1 2.7 2.5 2.7 2.5 0 4.5-3 5.5-6 1 3 3 6 5.5 6 1.5 0 2.5-1.2 2.5-2.7 ' +
  '0-1.8-1-3.5-3-4.3 2.5-1 4-3 4.7-5.8C22 5 21.5 4 20.5 4 16.5 4 13.5 7 12 11z';
const ICON_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">' +
  `<g class="jp-icon3" fill="#616161"><path d="${WINGS}"/></g></svg>`;

export const monarchIcon = new LabIcon({ name: 'monarch-nb:icon', svgstr: ICON_SVG });

namespace CommandIDs {
  export const refresh = 'monarch:refresh';
  export const show = 'monarch:show-sidebar';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'A sidebar listing the monarch-nb clusters with their GPUs and losses.',
  autoStart: true,
  requires: [ISettingRegistry],
  optional: [ILayoutRestorer, ICommandPalette],
  activate: async (
    app: JupyterFrontEnd,
    settingRegistry: ISettingRegistry,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const sidebar = new MonarchSidebar({
      interval: 2000,
      maxInterval: 15000,
      openDashboard: cluster => openDashboard(app, cluster)
    });
    sidebar.title.icon = monarchIcon;
    app.shell.add(sidebar, 'left', { rank: 600 });
    restorer?.add(sidebar, sidebar.id);

    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Monarch: Refresh Clusters',
      execute: () => sidebar.refresh()
    });
    app.commands.addCommand(CommandIDs.show, {
      label: 'Monarch: Show Clusters',
      execute: () => app.shell.activateById(sidebar.id)
    });
    palette?.addItem({ command: CommandIDs.refresh, category: 'Monarch' });
    palette?.addItem({ command: CommandIDs.show, category: 'Monarch' });

    try {
      const settings = await settingRegistry.load(PLUGIN_ID);
      const apply = () =>
        sidebar.setIntervals(
          settings.get('refreshInterval').composite as number,
          settings.get('maxInterval').composite as number
        );
      apply();
      settings.changed.connect(apply);
    } catch (error) {
      console.warn('monarch: settings not loaded; polling every 2 s', error);
    }
  }
};

export default [plugin, bokehLoaderPlugin];
