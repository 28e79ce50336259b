"""Host candidates aioice would not offer on its own.

aioice skips 127.0.0.1 when it gathers host candidates, so on a host whose only interface is
loopback no candidate exists and ICE never leaves "new". Its gatherer asks a module-level
function for the addresses; wrapping that function is the one hook aioice offers.
"""

from __future__ import annotations

import aioice.ice

_original = aioice.ice.get_host_addresses
_extra: list[str] = []


def _get_host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    found = _original(use_ipv4, use_ipv6)
    wanted = [a for a in _extra if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]
    return found + [a for a in wanted if a not in found]


def offer_host_addresses(addresses: list[str]) -> None:
    """Also gather host candidates on `addresses` (e.g. 127.0.0.1), in this process."""
    for address in addresses:
        if address not in _extra:
            _extra.append(address)
    aioice.ice.get_host_addresses = _get_host_addresses
