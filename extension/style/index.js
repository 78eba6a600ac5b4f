import './base.css';
import './hosts.css';
