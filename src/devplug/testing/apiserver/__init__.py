"""A stand-in Kubernetes API server for the DRA front, over real HTTP on 127.0.0.1: the
ResourceSlice routes a node driver uses, claims and nodes to read, with the answers a real
server gives (409, 410, 422), request counts, outages and a kubeconfig for any client.

:mod:`.server` routes the requests; :mod:`.store` keeps the objects as a real server treats
writes; :mod:`.watch` streams a watch; :mod:`.checks` and :mod:`.schema` refuse what a real
server refuses; :mod:`.field_selectors` reads field selectors; :mod:`.request` and
:mod:`.status` read requests and write answers as the API server does; :mod:`.http1` is the
HTTP/1.1 under them. Tests and plugin authors import from here.
"""

from devplug.testing.apiserver.checks import FieldProblem, SliceValidator
from devplug.testing.apiserver.field_selectors import POOL_NAME_FIELD_LABEL, SLICE_FIELD_LABELS
from devplug.testing.apiserver.schema import DEFAULT_SCHEMA_VERSION
from devplug.testing.apiserver.server import ApiServer, RequestRecord, TlsFiles, allocated_claim

__all__ = [
    "DEFAULT_SCHEMA_VERSION",
    "POOL_NAME_FIELD_LABEL",
    "SLICE_FIELD_LABELS",
    "ApiServer",
    "FieldProblem",
    "RequestRecord",
    "SliceValidator",
    "TlsFiles",
    "allocated_claim",
]
