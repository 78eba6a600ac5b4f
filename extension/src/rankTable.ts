import { Widget } from '@lumino/widgets';

import { el, formatNumber } from './format';
import { IRankRow, rankColor } from './types';

/** Each rank's state (as the scheduler sees its worker), last step and loss. */
export class RankTable extends Widget {
  constructor() {
    super();
    this.addClass('monarch-RankTable');
    const table = el('table', 'monarch-rank-table');
    const head = el('tr');
    for (const name of ['rank', 'host', 'state', 'step', 'loss']) {
      head.appendChild(el('th', '', name));
    }
    table.createTHead().appendChild(head);
    this._body = table.createTBody();
    this.node.appendChild(table);
  }

  render(rows: IRankRow[]): void {
    while (this._body.rows.length > rows.length) {
      this._body.deleteRow(-1);
    }
    while (this._body.rows.length < rows.length) {
      const tr = this._body.insertRow();
      for (let i = 0; i < 5; i++) {
        tr.insertCell();
      }
    }
    rows.forEach((row, i) => {
      const tr = this._body.rows[i];
      tr.dataset.rank = String(row.rank);
      const cells = tr.cells;
      cells[0].textContent = String(row.rank);
      cells[0].style.color = rankColor(row.rank);
      if (row.labels) {
        // under the number: its mesh coordinates, a pipeline stage's name
        cells[0].appendChild(el('div', 'monarch-rank-labels', row.labels));
      }
      cells[1].textContent = row.host ?? '-';
      cells[2].textContent = row.status;
      cells[2].className = `monarch-state monarch-state-${row.status}`;
      cells[3].textContent = row.step === null ? '-' : String(row.step);
      cells[4].textContent = formatNumber(row.loss);
    });
  }

  private _body: HTMLTableSectionElement;
}
