"""iotlake's MQTT clients: ``mqtt_client``, the factory the bridge, the simulator and the alert
channels take their paho clients from (TLS and the role's login applied), and
``BufferedClient``, a paho client with buffered reads, a fast path for QoS-1 PUBLISH and
batched PUBACKs (the bridge's).

Measured on the bridge (cProfile, 100k messages): paho 2.x reads every packet with at least
three ``recv`` calls (command byte, remaining-length bytes one at a time, then the body), builds
an ``MQTTMessage`` and, under MQTT v5, a ``Properties`` object (~25 us alone), and writes every
ack with its own ``send``. This subclass serves paho's reads from one large ``recv``, decodes the
complete QoS-1 PUBLISH packets already in that buffer itself (``drain_publishes``: topic, id,
retain flag, payload; v5 properties are skipped, the bridge forwards none), and sends the
PUBACKs of a whole delivery round as one write. Every other packet — CONNACK, SUBACK, PINGRESP,
QoS 0/2, a packet split across reads — and everything else (connect, TLS, auth, keepalive,
reconnects) stays paho's.

It overrides private hooks of paho (``_sock_recv``, ``_sock_close``) and uses its
``_packet_queue`` and ``_last_bytes_received``; pyproject pins paho-mqtt to the 2.x line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import paho.mqtt.client as mqtt
from paho.mqtt.enums import _ConnectionState

from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.settings import Settings

#: One ``recv`` reads up to this much; ~1,500 telemetry messages of ~170 bytes.
READ_CHUNK = 256 * 1024
_PUBACK = 0x40


def mqtt_client(settings: Settings, client_id: str = "", protocol: int = mqtt.MQTTv311,
                client_class: type[mqtt.Client] = mqtt.Client, role: str = "simulator",
                **kwargs) -> mqtt.Client:
    """A paho 2.x client with TLS and the credential of iotlake's client ``role`` applied
    (``lakehouse.mqtt_auth.login``: the settings' user, or the role's own on the embedded
    broker; never logged)."""
    c = client_class(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                     **kwargs)
    mqtt_auth.configure_client(c, settings, role)
    return c


class BufferedClient(mqtt.Client):
    """``mqtt.Client`` whose socket reads go through a user-space buffer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rbuf = b""
        self._rpos = 0
        self._v5 = kwargs.get("protocol") == mqtt.MQTTv5

    def buffered(self) -> int:
        """Bytes received but not yet parsed (``select()`` cannot see them)."""
        return len(self._rbuf) - self._rpos

    def _sock_recv(self, bufsize: int) -> bytes:
        if self._rpos >= len(self._rbuf):
            data = super()._sock_recv(READ_CHUNK)  # BlockingIOError / b"" (EOF) pass through
            if data and hasattr(self._sock, "pending"):
                data = self._more_records(data)
            if len(data) <= bufsize:
                return data
            self._rbuf, self._rpos = data, 0
        out = self._rbuf[self._rpos:self._rpos + bufsize]
        self._rpos += len(out)
        return out

    def _more_records(self, first: bytes) -> bytes:
        """Under TLS one ``recv`` returns one record, and Mosquitto writes a record per packet:
        without this every message would take paho's slow path alone. Gather the records that
        have arrived (up to ``READ_CHUNK``); an EOF or error after them shows at the next read."""
        parts, size = [first], len(first)
        while size < READ_CHUNK:
            try:
                more = super()._sock_recv(READ_CHUNK - size)
            except (BlockingIOError, ConnectionError, OSError):
                break
            if not more:
                break
            parts.append(more)
            size += len(more)
        return b"".join(parts) if len(parts) > 1 else first

    def _sock_close(self) -> None:
        # bytes of a dead connection must never be parsed as the start of a new one
        self._rbuf, self._rpos = b"", 0
        super()._sock_close()

    def ack_many(self, mids: Iterable[int]) -> None:
        """PUBACK (QoS 1) every id in order, as one write."""
        blob = b"".join(b"\x40\x02" + mid.to_bytes(2, "big") for mid in mids)
        if blob:
            self._packet_queue(_PUBACK, blob, 0, 0)

    def drain_publishes(self, handler: Callable[[bytes, int, int, bytes], None],
                        limit: int) -> int:
        """Decode up to ``limit`` complete QoS-1 PUBLISH packets at the head of the buffer and
        call ``handler(topic, mid, retain, payload)`` for each; returns how many.

        Stops at the first packet that is anything else or incomplete: paho's ``loop_read``
        takes it from there, so packet order is kept.
        """
        if self._in_packet["command"] or self._state != _ConnectionState.MQTT_CS_CONNECTED:
            return 0  # paho is in the middle of a packet, or not connected yet
        buf, pos, n, v5 = self._rbuf, self._rpos, len(self._rbuf), self._v5
        done = 0
        while done < limit and pos + 2 <= n:
            cmd = buf[pos]
            if cmd & 0xF6 != 0x32:  # PUBLISH with QoS 1 (dup and retain flags free)
                break
            q, rl, mult = pos + 1, 0, 1
            while True:
                if q >= n or q > pos + 4:
                    rl = -1
                    break
                b = buf[q]
                q += 1
                rl += (b & 127) * mult
                if b < 128:
                    break
                mult <<= 7
            end = q + rl
            if rl < 4 or end > n:
                break
            tl = buf[q] << 8 | buf[q + 1]
            r = q + 2 + tl
            if tl == 0 or r + 2 > end:  # topic alias or malformed: paho's problem
                break
            mid = buf[r] << 8 | buf[r + 1]
            r += 2
            if v5:  # skip the properties (a variable byte integer length, then the bytes)
                plen, mult = 0, 1
                while r < end:
                    b = buf[r]
                    r += 1
                    plen += (b & 127) * mult
                    if b < 128:
                        break
                    mult <<= 7
                r += plen
                if r > end:
                    break
            handler(buf[q + 2:q + 2 + tl], mid, cmd & 1, buf[r:end])
            pos = end
            done += 1
        if done:
            self._rpos = pos
            with self._msgtime_mutex:
                self._last_bytes_received = mqtt.time_func()
        return done
