"""What a replica behind a load balancer says about itself, and the conversation key it is sent.

Each replica names itself in every answer (``x-colibri-replica``) and in ``/health``, so a client or
a test sees where a turn ran. A conversation key (``X-Session-Id``) is what nginx hashes to send a
conversation's turns back to one replica (``coli deploy nginx``, docs/deploy.md), and whose KV cache
a request may reuse (``slot_owners``). A malformed one is refused with a 400, the same answer
nginx's configuration gives, so a client learns the rule with or without the balancer. It is data:
never echoed into a header, a log line or configuration.
"""

from __future__ import annotations

import re

REPLICA_HEADER = "x-colibri-replica"
SESSION_HEADER = "x-session-id"
# A conversation key is an id the client made up (a UUID is 36 characters); 128 leaves room for
# prefixed ones ("team-a:user-7:conv-1234") while bounding what a hash key may cost.
MAX_SESSION_ID = 128
# Letters, digits and . _ : @ - : what ids are made of, and nothing that could end a header line,
# start an nginx variable or hide in a log. The same pattern is in the nginx configuration.
SESSION_ID_PATTERN = rf"[A-Za-z0-9._:@-]{{1,{MAX_SESSION_ID}}}"
# A replica id travels as a header value: the same alphabet, plus the brackets of an IPv6 host:port.
MAX_REPLICA_ID = 128
_REPLICA_ID = re.compile(rf"[A-Za-z0-9._:@\[\]-]{{1,{MAX_REPLICA_ID}}}")
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def valid_replica_id(value: str) -> bool:
    return _REPLICA_ID.fullmatch(value) is not None


def valid_session_id(value: str) -> bool:
    return _SESSION_ID.fullmatch(value) is not None


def default_replica_id(bind: str) -> str:
    """host:port of a bound address as hypercorn prints it (``http://127.0.0.1:8000``)."""
    return bind.split("://", 1)[-1].rstrip("/")
