"""The operator's dashboard, served by the proxy at `/dashboard` (docs/dashboard.md): a static page (HTML,
vanilla JS, inline SVG charts; no build step, nothing fetched from elsewhere) and the admin-only JSON
endpoints under `/dashboard/api/` it polls, which scripts may use too. Layers: `routes` > `sessions` |
`charts` > `documents` | `params` | `page`."""
