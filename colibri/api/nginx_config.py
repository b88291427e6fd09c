"""``coli deploy nginx``: a standalone nginx configuration for several ``coli serve`` replicas.

A conversation's KV lives in one replica's slots, so its turns must go back there: requests with
an ``X-Session-Id`` header are hashed on it (consistent hashing: adding or losing a replica moves
only its share of conversations), requests without one go to the least busy replica. Streams pass
unbuffered; a request is retried on another replica only while it has not been sent to one (a
replica that refuses the connection or does not accept it in time), never once a replica may have
started generating: a POST is not idempotent and nginx, without ``non_idempotent``, does not resend
it. Passive health checks take a failed replica out for ``fail_timeout``; after that a request
tries it again, and it rejoins once it answers. docs/deploy.md, "More than one engine", explains
each directive.

The file runs as it is: ``mkdir -p DIR/logs && nginx -p DIR -c FILE`` (add ``-g 'daemon off;'`` to
keep it in the foreground); its ``http`` block's contents fit an existing nginx's ``conf.d``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from colibri.api import openai_errors
from colibri.api.affinity import MAX_SESSION_ID, SESSION_ID_PATTERN
from colibri.errors import ColibriError

# A replica that is not accepting connections within this is taken as down and the request goes to
# the next one: a live replica accepts at once (hypercorn's accept loop never waits on generation).
CONNECT_TIMEOUT_S = 2
# Longest silence between two reads from a replica: a non-streamed answer says nothing until its
# generation ends, and a long one on a CPU-streamed MoE model can take most of an hour.
READ_TIMEOUT_S = 3600
# A failed attempt takes a replica out for this long; then the next request tries it again.
FAIL_TIMEOUT_S = 10
MAX_FAILS = 1  # one refused connection is enough: a killed replica refuses every one
# How long nginx keeps trying other replicas for one request that has not been sent anywhere.
NEXT_UPSTREAM_TIMEOUT_S = 10
# The largest body nginx takes: the replicas' --max-body-mb default (4 MiB), so a body the replica
# would refuse is refused by nginx first, before it is buffered.
MAX_BODY_MB = 4
WORKER_CONNECTIONS = 1024  # per nginx worker: each stream holds two (client, replica)

_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(?P<port>[0-9]{1,5})")


@dataclass(frozen=True)
class NginxPlan:
    listen: str
    replicas: tuple[str, ...]
    fail_timeout_s: int = FAIL_TIMEOUT_S
    max_fails: int = MAX_FAILS
    read_timeout_s: int = READ_TIMEOUT_S
    max_body_mb: float = MAX_BODY_MB


def host_port(value: str, what: str) -> str:
    """``HOST:PORT`` checked, so nothing but an address reaches the configuration's text."""
    m = _HOST_PORT.fullmatch(value.strip())
    if m is None or not 1 <= int(m["port"]) <= 65535:
        raise ColibriError(f"{what} must be HOST:PORT (a name, an IPv4 address or [IPv6]), got {value!r}")
    return f"{m['host']}:{int(m['port'])}"


def plan(listen: str, replicas: list[str], **limits: float) -> NginxPlan:
    """The checked inputs of a configuration; a ColibriError names the first bad one."""
    if not replicas:
        raise ColibriError("give at least one --replica HOST:PORT")
    checked = tuple(host_port(r, "--replica") for r in replicas)
    if len(set(checked)) != len(checked):
        raise ColibriError("each --replica must be given once")
    for name, value in limits.items():
        if not value > 0:
            raise ColibriError(f"--{name.removesuffix('_s').replace('_', '-')} must be positive")
    return NginxPlan(host_port(listen, "--listen"), checked,
                     **{k: int(v) if k != "max_body_mb" else v for k, v in limits.items()})


def render(p: NginxPlan) -> str:
    """The whole configuration file."""
    servers = "\n".join(
        f"        server {r} max_fails={p.max_fails} fail_timeout={p.fail_timeout_s}s;" for r in p.replicas
    )
    return _TEMPLATE.format(
        replicas=" ".join(p.replicas), listen=p.listen, servers=servers, n=len(p.replicas),
        session_re=SESSION_ID_PATTERN, session_max=MAX_SESSION_ID, connect=CONNECT_TIMEOUT_S,
        read=p.read_timeout_s, next_timeout=NEXT_UPSTREAM_TIMEOUT_S, body=f"{p.max_body_mb:g}m",
        worker_connections=WORKER_CONNECTIONS,
        session_error=_quoted(openai_errors.invalid_session_id(MAX_SESSION_ID)),
        unreachable_error=_quoted(openai_errors.replica_unreachable()),
    )


def _quoted(err: openai_errors.ApiError) -> str:
    """An error body as the text of a single-quoted nginx string (the server's own words)."""
    text = err.json_bytes().decode()
    assert not set(text) & set("'\\$\n"), text  # nothing that would end or expand the string
    return text


_TEMPLATE = """\
# colibri: {n} coli serve replica(s) behind nginx, written by `coli deploy nginx` (docs/deploy.md).
# Replicas: {replicas}
# Run: mkdir -p DIR/logs && nginx -p DIR -c THIS_FILE   (add -g 'daemon off;' for the foreground)
worker_processes auto;
pid logs/nginx.pid;
error_log logs/error.log warn;

events {{
    worker_connections {worker_connections};
}}

http {{
    # Which replica served what, and how long nginx and the replica took (nginx's overhead is the
    # difference between request_time and upstream_response_time).
    log_format colibri '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                       'replica=$upstream_addr upstream_status=$upstream_status '
                       'request_time=$request_time upstream_time=$upstream_response_time';
    access_log logs/access.log colibri;
    client_body_temp_path client_body_temp;
    proxy_temp_path proxy_temp;
    fastcgi_temp_path fastcgi_temp;
    uwsgi_temp_path uwsgi_temp;
    scgi_temp_path scgi_temp;
    server_tokens off;

    # The conversation key: a valid X-Session-Id picks the hashed pool, none the least busy one.
    # Anything else is refused (400) below: the key is data, 1-{session_max} of A-Z a-z 0-9 . _ : @ -
    map $http_x_session_id $colibri_pool {{
        ""                          colibri_least_busy;
        "~^{session_re}$" colibri_by_session;
        default                     invalid;
    }}

    # The same replicas twice: nginx balances each upstream block by one method. Each block keeps
    # its own failure counts, so a dead replica is found by each pool's first request to it.
    upstream colibri_by_session {{
        hash $http_x_session_id consistent;
{servers}
    }}
    upstream colibri_least_busy {{
        least_conn;
{servers}
    }}

    server {{
        listen {listen};
        client_max_body_size {body};
        default_type application/json;

        location / {{
            if ($colibri_pool = invalid) {{
                return 400 '{session_error}\\n';
            }}
            proxy_pass http://$colibri_pool;
            proxy_http_version 1.1;
            # A loopback-bound replica accepts only loopback names (DNS-rebinding guard); one bound
            # beyond loopback accepts any. The client's own Host goes as X-Forwarded-Host.
            proxy_set_header Host localhost;
            proxy_set_header X-Forwarded-Host $host;
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_set_header X-Forwarded-Proto $scheme;
            proxy_set_header Authorization $http_authorization;  # the API key, as the client sent it
            # Streams token by token: nothing held back, neither the answer nor a cached copy.
            proxy_buffering off;
            proxy_cache off;
            proxy_connect_timeout {connect}s;
            proxy_read_timeout {read}s;
            proxy_send_timeout 60s;
            send_timeout 300s;
            # Another replica only for a request no replica has been sent: POST is not idempotent,
            # so nginx never resends one that reached a replica (no `non_idempotent`).
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries {n};
            proxy_next_upstream_timeout {next_timeout}s;
            error_page 502 504 = @colibri_unreachable;
        }}

        location @colibri_unreachable {{
            return 502 '{unreachable_error}\\n';
        }}
    }}
}}
"""
