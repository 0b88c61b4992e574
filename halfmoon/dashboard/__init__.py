"""The operator dashboard (`/dashboard` on the Conductor's HTTP port, docs/DASHBOARD.md): live
pools and SLO attainment, and a sizing page that runs the simulator's sweep and ends in Helm
values. `dashboard.routes.mount(app, door)` adds it to the front door's app."""
