"""Operations: commands that run chatcore's processes rather than serve chats.

`chatcore cluster up|down` (docs/deploy.md) starts PostgreSQL (if asked), N `chatcore serve`
replicas and nginx on loopback, for local use. Nothing here is a router or a database of our own:
it starts Debian's PostgreSQL and nginx binaries and `chatcore serve` processes.

| module | owns |
|---|---|
| `command` | the `chatcore cluster` command line: run `up` or `down`, print the outcome |
| `cluster` | the whole cluster's lifecycle: start the parts in order, undo on failure, record and stop them |
| `replicas` | one `chatcore serve` replica, and the shared state prepared once before any starts |
| `nginx` | nginx's configuration (rendered from deploy/nginx.conf) and its process |
| `postgres` | a PostgreSQL cluster of our own: initdb, password authentication, start and stop |
| `processes` | process supervision: free ports, health polling, stopping a pid we started |
| `files` | files written and read without following links (run as root) |
| `errors` | `ClusterError` and the log tail that explains a part that failed to start |

The tests use the same helpers to start their throw-away PostgreSQL and nginx.
"""
