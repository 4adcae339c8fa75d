"""``phoenix serve`` with its OTLP/gRPC server on 127.0.0.1, run with Phoenix's own Python.

Phoenix 20.x binds its gRPC receiver to ``[::]:<PHOENIX_GRPC_PORT>`` in code (no host setting;
``PHOENIX_HOST`` binds only the HTTP side). A test server must listen on loopback only, so this
launcher rewrites the wildcard address given to grpc's asyncio server before Phoenix starts.
Arguments are Phoenix's (``serve``).
"""

from __future__ import annotations

import runpy
import sys

import grpc.aio._server as _grpc_server

_WILDCARDS = ("[::]:", "0.0.0.0:")


def _loopback(address: str) -> str:
    for wildcard in _WILDCARDS:
        if address.startswith(wildcard):
            return "127.0.0.1:" + address[len(wildcard):]
    return address


def _bind_loopback(name: str) -> None:
    original = getattr(_grpc_server.Server, name)

    def bind(self, address, *args, **kwargs):
        return original(self, _loopback(address), *args, **kwargs)

    setattr(_grpc_server.Server, name, bind)


for _name in ("add_insecure_port", "add_secure_port"):
    _bind_loopback(_name)

sys.argv = ["phoenix", *sys.argv[1:]]
runpy.run_module("phoenix.server.main", run_name="__main__", alter_sys=True)
