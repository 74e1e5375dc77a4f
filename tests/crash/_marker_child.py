"""A child process whose writer keeps two rollouts' in-flight markers, then SIGKILLs itself.

    python _marker_child.py DIR

``ended``: its call's ``+`` and then its line written (its marker kept, no call in flight); ``open``: its
call's ``+`` written, no line. Exit status 0 means the kill never came (the parent fails the test)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from otel_capture._store import JsonlWriter, LoopWaiter


async def _record(writer: JsonlWriter, rollout_id: str, model_call_id: str) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    line = b'{"model_call_id":"%s"}\n' % model_call_id.encode()
    writer.submit(rollout_id, line, model_call_id, None, LoopWaiter(loop, future))
    await asyncio.wait_for(future, 60)


def main() -> None:
    writer = JsonlWriter(sys.argv[1], marker_delay=60)
    writer.begin("ended", "c1")
    writer.begin("open", "c1")
    if not writer.flush(60):  # both "+" markers written
        sys.exit(2)
    asyncio.run(_record(writer, "ended", "c1"))  # its "-": the marker is kept, no call in flight
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
