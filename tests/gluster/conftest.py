"""The GlusterFS volume with two FUSE clients ("nodes") (tests/gluster_cluster.py), brought up once for this
folder, so another session waiting for the machine's cluster waits for these tests only. Where this machine
cannot run it (not root, no FUSE, no packages), the tests skip and say why; under ``CI=true`` they fail
instead (:func:`gluster_cluster.not_here`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gluster_cluster import Gluster, GlusterUnavailable, not_here, running_gluster, unavailable


@pytest.fixture(scope="package")
def gluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gluster]:
    reason = unavailable()
    if reason is None:
        try:
            with running_gluster(tmp_path_factory.mktemp("gluster")) as cluster:
                yield cluster
            return
        except GlusterUnavailable as exc:
            reason = str(exc)
    not_here(reason)
