"""The cluster index's Lua scripts (package data under kvpool/lua/) and how one is sent.

Each script file documents its KEYS, ARGV and reply. Every script is run after the prelude
`now.lua` (the server clock in ms as `now`); those that must tell live holders from dead ones
also get `alive.lua`. `PackedScript` sends the lookup, the one script on the hot path, as a
hand-packed EVALSHA.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import redis
from redis.exceptions import NoScriptError

# Preludes a script needs besides `now.lua`.
_PRELUDES: dict[str, tuple[str, ...]] = {"apply": ("alive",), "sweep": ("alive",)}


def _read(name: str) -> str:
    return resources.files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def script_source(name: str) -> str:
    """The full source of script `name` (kvpool/lua/<name>.lua) with its preludes."""
    parts = ("now", *_PRELUDES.get(name, ()), name)
    return "\n".join(_read(part) for part in parts)


def resp_bulk(arg: bytes) -> bytes:
    """`arg` as a RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class PackedScript:
    """A Lua script run as a hand-packed EVALSHA on connections of its own.

    For the lookup's ~70 arguments redis-py's generic command packer and its pool bookkeeping
    cost more client CPU than the server spends running the script; packing the fixed parts
    once, the block keys with one `bytes.join`, and keeping a few idle connections here (a
    list: `pop`/`append` are atomic, so concurrent lookups each get their own) makes the lookup
    fast enough for the 5,000/s target.
    """

    def __init__(self, source: str, client: redis.Redis) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest().encode()
        self._client = client
        self._idle: list[redis.connection.AbstractConnection] = []

    def head(self, *, num_args: int, num_keys: int) -> bytes:
        """RESP of `*<n> EVALSHA <sha> <numkeys>`: `num_args` counts the arguments after it."""
        keys = str(num_keys).encode()
        return b"*%d\r\n$7\r\nEVALSHA\r\n%s%s" % (num_args + 3, resp_bulk(self.sha),
                                                     resp_bulk(keys))

    def run(self, packed: bytes) -> object:
        """Send `packed` and return the reply; loads the script once if the server lacks it."""
        conn = self._take()
        try:
            reply = self._send(conn, packed)
        except BaseException:
            conn.disconnect()
            raise
        self._idle.append(conn)
        return reply

    def close(self) -> None:
        while self._idle:
            self._idle.pop().disconnect()

    def _send(self, conn: redis.connection.AbstractConnection, packed: bytes) -> object:
        conn.send_packed_command([packed], check_health=False)
        try:
            return conn.read_response()
        except NoScriptError:  # a restarted server: load the script, then once more
            self._client.script_load(self.source)
        conn.send_packed_command([packed], check_health=False)
        return conn.read_response()

    def _take(self) -> redis.connection.AbstractConnection:
        try:
            conn = self._idle.pop()
        except IndexError:
            pool = self._client.connection_pool
            return pool.connection_class(**pool.connection_kwargs)
        if conn.can_read():  # the server closed it (restart) or left data: start afresh
            conn.disconnect()
        return conn
