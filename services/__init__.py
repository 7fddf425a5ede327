"""Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported: set here, before any module of this package
imports ray, so that a local cluster started from it stays on loopback (environment.md). Not when joining a
cluster (RAY_ADDRESS), whose nodes have real addresses."""

import os

if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
