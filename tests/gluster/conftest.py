"""The GlusterFS volume with two FUSE clients ("nodes"), brought up once for this folder (tests/gluster_cluster.py), so another session waiting on it waits only for these tests.
Where this machine cannot run it (not root, no FUSE, no packages), the tests skip and say why; under
``CI=true`` they fail instead: CI must run them (``.ci/run`` installs the packages)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from gluster_cluster import Gluster, GlusterUnavailable, running_gluster, unavailable


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
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{reason}; CI=true: the GlusterFS tests must run here", pytrace=False)
    pytest.skip(reason)
