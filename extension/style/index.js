import './base.css';
import './hosts.css';
import './ft.css';
