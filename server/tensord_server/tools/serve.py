"""``tensord serve``: run the server until SIGTERM/SIGINT, then stop gracefully.

Prints ``tensord listening on <address>`` (the real port, so ``--address
127.0.0.1:0`` works for tests and scripts) once it accepts calls.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

from tensord.errors import FailedPreconditionError
from tensord.protocol import DEFAULT_ADDRESS

from tensord_server.cluster import (
    DEFAULT_CLUSTER_LEASE_S,
    MIN_CLUSTER_LEASE_S,
    check_node_id,
    parse_duration,
    parse_endpoints,
)
from tensord_server.devices.descriptors import raise_descriptor_limit
from tensord_server.devices.table import parse_bytes, resolve_specs
from tensord_server.domain.auth import load_cluster_token, load_tokens
from tensord_server.domain.call_gate import (
    DEFAULT_MAX_WORKERS,
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    default_max_streams,
)
from tensord_server.domain.limits import DEFAULT_MAX_BATCH_ELEMENTS, DEFAULT_MAX_OP_ELEMENTS
from tensord_server.domain.quotas import parse_quota
from tensord_server.domain.sessions import DEFAULT_GRACE_S, DEFAULT_LEASE_S
from tensord_server.domain.share_tokens import DEFAULT_MAX_SHARE_TTL_S, DEFAULT_SHARE_TTL_S
from tensord_server.domain.spiller import DEFAULT_RESTORE_WORKERS, DEFAULT_SPILL_WORKERS
from tensord_server.domain.store import TensorStore
from tensord_server.observability import configure_logging  # observability hook
from tensord_server.pool import (
    DEFAULT_POLICY,
    POLICIES,
    TRACE_MAX_ENTRIES,
    default_warm_reserve,
    policy_named,
)
from tensord_server.pool.policy import ADAPTIVE, WARM_RESERVE_MAX, WARM_RESERVE_SHARE
from tensord_server.rpc.grpc_server import create_server
from tensord_server.rpc.tls import read_roots, server_credentials
from tensord_server.tools import serve_observability  # observability hook

if TYPE_CHECKING:
    from tensord_server.cluster.node import ClusterNode

# In-flight calls get this long to finish after SIGTERM/SIGINT before they are cancelled.
SHUTDOWN_GRACE_S = 5.0
# How long a server thread runs Python before another waiting for the GIL may take it
# (CPython's default: 5 ms).  Each of a call's handoffs (event loop -> worker -> event loop)
# waits up to one interval behind another tenant's busy worker, so the interval is what a
# heavy tenant adds to everyone else's latency; with one worker per active tenant (the
# fair queue's share) a short interval costs the many-client throughput nothing measurable.
DEFAULT_GIL_SWITCH_INTERVAL_S = 0.002
# The longest switch interval accepted: beyond it one busy thread could delay every other
# call by more than a second.
MAX_GIL_SWITCH_INTERVAL_S = 1.0
# The shortest lease per switch interval (0.5 s at the default): see apply_gil_switch_interval.
LEASE_PER_GIL_SWITCH = 10

log = logging.getLogger("tensord.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"HOST:PORT or unix:PATH to listen on (default: {DEFAULT_ADDRESS}; port 0: any)",
    )
    parser.add_argument(
        "--device",
        action="append",
        dest="devices",
        metavar="DEVICE[=LIMIT]",
        help="a device to own, with an optional pool limit: cpu, cpu=8GiB, cuda:0=40GiB "
        "(repeatable; default: cpu and every GPU CuPy sees)",
    )
    parser.add_argument(
        "--no-pinned-host",
        action="store_true",
        help="keep the cpu pool in pageable memory even when the server owns a GPU",
    )
    parser.add_argument(
        "--session-grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="how long a lost client's handles survive, for it to reconnect "
        f"(default: {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="SECONDS",
        help="a client is lost this long after its last call or heartbeat (the SDK beats "
        "every lease/3) "
        f"(default: {DEFAULT_LEASE_S:g})",
    )
    parser.add_argument(
        "--gil-switch-interval",
        type=float,
        default=DEFAULT_GIL_SWITCH_INTERVAL_S,
        metavar="SECONDS",
        help="how long a server thread runs Python before another may take the GIL "
        f"(sys.setswitchinterval; at most {MAX_GIL_SWITCH_INTERVAL_S:g}) "
        f"(default: {DEFAULT_GIL_SWITCH_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=DEFAULT_MAX_WORKERS,
        help="threads running calls' work, shared fairly between tenants (a call waiting for "
        "its request, a worker or its reader holds none) "
        f"(default: {DEFAULT_MAX_WORKERS})",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        metavar="N",
        help="Upload, Download, health Watch and reflection streams open together; over it: "
        "RESOURCE_EXHAUSTED (default: --max-workers less a quarter, at least 1)",
    )
    parser.add_argument(
        "--max-streams-per-tenant",
        type=int,
        metavar="N",
        help="streams one tenant may hold open (RESOURCE_EXHAUSTED; default: half of "
        "--max-streams with --auth-tokens, all of them without)",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=DEFAULT_STREAM_IDLE_TIMEOUT_S,
        metavar="SECONDS",
        help="cancel a stream (DEADLINE_EXCEEDED) whose client sends no Upload chunk or reads "
        "no Download chunk for this long; a KeepAlive gets at least its lease "
        f"(default: {DEFAULT_STREAM_IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--share-ttl",
        type=float,
        default=DEFAULT_SHARE_TTL_S,
        metavar="SECONDS",
        help="a share token's lifetime unless x.share(ttl=...) asks for another "
        f"(default: {DEFAULT_SHARE_TTL_S:g})",
    )
    parser.add_argument(
        "--max-share-ttl",
        type=float,
        default=DEFAULT_MAX_SHARE_TTL_S,
        metavar="SECONDS",
        help="the longest lifetime x.share(ttl=...) may ask for; a longer or non-finite one "
        f"is refused (default: {DEFAULT_MAX_SHARE_TTL_S:g})",
    )

    parser.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="require 'authorization: Bearer TOKEN' on every call; FILE has one 'TOKEN TENANT' "
        "per line (# comments); sessions, share tokens and names are scoped to the tenant",
    )
    parser.add_argument(
        "--max-handles-per-session",
        type=int,
        metavar="N",
        help="refuse a session's new handle or share token once it holds N of them together "
        "(RESOURCE_EXHAUSTED; default: none)",
    )
    parser.add_argument(
        "--max-op-elements",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_OP_ELEMENTS,
        help="refuse an op that would read or write more than N elements (fill_, copy_, "
        "setitem, clone, contiguous, to, cat, stack, repeat, download, arange, full; "
        "RESOURCE_EXHAUSTED) "
        f"(default: {DEFAULT_MAX_OP_ELEMENTS})",
    )
    parser.add_argument(
        "--max-batch-elements",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_BATCH_ELEMENTS,
        help="refuse the op of a pipelined Batch that would take the elements its ops read "
        "or write together over N (that op fails RESOURCE_EXHAUSTED, the ops before it "
        f"stay applied) (default: {DEFAULT_MAX_BATCH_ELEMENTS})",
    )
    parser.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        metavar="N",
        help="refuse a tenant's new session once it has N open (lost ones count until their "
        "grace ends; RESOURCE_EXHAUSTED; default: none)",
    )
    parser.add_argument(
        "--max-names-per-tenant",
        type=int,
        metavar="N",
        help="refuse a tenant's new tensor name once it has N (overwriting one is not new; "
        "RESOURCE_EXHAUSTED; default: none)",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve TLS only, with this PEM certificate chain (needs --tls-key)",
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the PEM private key of --tls-cert")
    parser.add_argument(
        "--quota",
        action="append",
        dest="quotas",
        default=[],
        metavar="TENANT:DEVICE=BYTES",
        help="most bytes a tenant's tensors may hold on a device, e.g. alice:cuda:0=40GiB; "
        "TENANT '*' is every tenant without its own (each separately; without --auth-tokens "
        "only '*' applies); over it: RESOURCE_EXHAUSTED (repeatable; default: none)",
    )
    parser.add_argument(
        "--no-compaction",
        action="store_true",
        help="never move Storages to make room when a device's pool is out of memory "
        "(PyTorch's allocator exactly: OOM once release-and-retry fails)",
    )
    parser.add_argument(
        "--policy",
        choices=sorted(POLICIES),
        default=DEFAULT_POLICY,
        help="what each device's pool does beyond PyTorch's allocator rules: pytorch (nothing, "
        "and no compaction), oom-compaction (compaction where PyTorch would be out of memory), "
        "adaptive (also tight segments and repacking under pressure, idle cached segments given "
        "back after a free and compaction in a background thread, one Storage at a time, while "
        "reserved exceeds allocated by more than 8 MiB) "
        f"(default {DEFAULT_POLICY})",
    )
    parser.add_argument(
        "--warm-reserve",
        metavar="BYTES",
        help="bytes of wholly free segments each device's pool keeps warm for "
        f"{ADAPTIVE.warm_reserve_s:g} s after their last free (policy adaptive), the most "
        "recently freed first, so a put after a pause writes warm pages instead of faulting "
        f"in new ones; 0: none (idle segments go back after {ADAPTIVE.release_idle_s:g} s) "
        f"(default: 1/{round(1 / WARM_RESERVE_SHARE)} of the device's capacity, at most "
        f"{WARM_RESERVE_MAX >> 30} GiB)",
    )
    parser.add_argument(
        "--record-history",
        action="store_true",
        help="record each pool's allocator events, as torch.cuda.memory._record_memory_history "
        f"does (the last {TRACE_MAX_ENTRIES:,} per device), so that a 'tensord snapshot' file "
        "holds a trace "
        "'tensord replay' can run",
    )
    parser.add_argument(
        "--insecure-allow-remote",
        action="store_true",
        help="listen on a non-loopback address without --auth-tokens (anyone who can reach "
        "it can use it)",
    )
    parser.add_argument(
        "--node-id",
        metavar="NAME",
        help="this server's name in its cluster (letters, digits, '_', '.', '-'; needs --cluster)",
    )
    parser.add_argument(
        "--cluster",
        metavar="etcd://HOST:PORT[,HOST:PORT...]",
        help="join the cluster kept in this etcd (needs --node-id and the 'cluster' extra): "
        "names become one namespace per tenant across the nodes (default: a server alone)",
    )
    parser.add_argument(
        "--cluster-lease",
        default=f"{DEFAULT_CLUSTER_LEASE_S:g}s",
        metavar="DURATION",
        help="the etcd lease this node's membership and names are bound to: a lost node's "
        "names vanish within it, plus a third of it (e.g. 10s, 2500ms; at least "
        f"{MIN_CLUSTER_LEASE_S:g}s) (default: {DEFAULT_CLUSTER_LEASE_S:g}s)",
    )
    parser.add_argument(
        "--cluster-advertise",
        metavar="HOST:PORT",
        help="the address other nodes' clients reach this server at (default: --address "
        "with its real port; its host if it names one)",
    )
    parser.add_argument(
        "--cluster-token-file",
        metavar="PATH",
        default=os.environ.get("TENSORD_CLUSTER_TOKEN_FILE"),
        help="a file whose first line is the cluster's shared secret (16+ characters, not a "
        "tenant's token): the credential of node-to-node calls (cross-node copies); a node "
        "without it neither makes nor accepts them (default: $TENSORD_CLUSTER_TOKEN_FILE)",
    )
    parser.add_argument(
        "--cluster-ca",
        metavar="FILE",
        help="PEM root certificates (one or more CAs, or the nodes' self-signed "
        "certificates) that a node serving TLS checks the other nodes' certificates "
        "against in its node-to-node calls, which then use TLS and never plaintext; "
        "needed with --cluster and --tls-cert, refused without --cluster or without "
        "--tls-cert",
    )
    parser.add_argument(
        "--host-tier",
        metavar="LIMIT",
        help="host memory, outside every pool, that Storages spill to when a device pool is "
        "past its high watermark or an allocation would fail, e.g. 64GiB (shared by the "
        "devices; on a cpu-only server the same RAM, beside the pool's limit) (default: none)",
    )
    parser.add_argument(
        "--disk-tier",
        metavar="DIR=LIMIT",
        help="a preallocated scratch file of LIMIT bytes per device in DIR that Storages "
        "spill to below the host tier, checksummed; swept at start, removed at stop, e.g. "
        "/scratch=8GiB (default: none)",
    )
    parser.add_argument(
        "--spill-workers",
        type=int,
        default=DEFAULT_SPILL_WORKERS,
        metavar="N",
        help=f"threads spilling in the background (default: {DEFAULT_SPILL_WORKERS})",
    )
    parser.add_argument(
        "--restore-workers",
        type=int,
        default=DEFAULT_RESTORE_WORKERS,
        metavar="N",
        help=f"threads restoring prefetched Storages (default: {DEFAULT_RESTORE_WORKERS})",
    )
    # observability hook: --metrics-address, --dashboard-address, --log-format, ...
    serve_observability.add_arguments(parser)


def parse_disk_tier(text: str) -> tuple[str, int]:
    """``--disk-tier DIR=LIMIT`` -> (DIR, bytes); ValueError naming the flag."""
    directory, sep, limit = text.rpartition("=")
    if not sep or not directory:
        raise ValueError(f"--disk-tier {text!r}: expected DIR=LIMIT, e.g. /scratch=8GiB")
    nbytes = parse_bytes(limit)
    if nbytes <= 0:
        raise ValueError(f"--disk-tier {text!r}: its limit must be above 0")
    return directory, nbytes


def parse_host_tier(text: str) -> int:
    nbytes = parse_bytes(text)
    if nbytes <= 0:
        raise ValueError(f"--host-tier {text!r}: its limit must be above 0")
    return nbytes


class UnresolvableHostError(ValueError):
    """The host of a listening address does not resolve."""


def listen_host(address: str) -> str:
    """The host of HOST:PORT, without the brackets of an IPv6 literal ([::1]:50051 -> ::1);
    a bare IP address (no port) is its own host."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    bare = address.startswith("[") and address.endswith("]")  # [::1] without a port
    host = address.rpartition(":")[0] if ":" in address and not bare else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_loopback(address: str) -> bool:
    """True for a unix: socket or a host whose every address is loopback (anything else may
    be reachable remotely); a name is resolved, so 127.example.com is judged by where it
    points.  UnresolvableHostError when the host does not resolve."""
    if address.startswith("unix:"):
        return True
    host = listen_host(address)
    if not host:
        return False  # ":50051" listens on every interface
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise UnresolvableHostError(
            f"cannot resolve the host {host!r} of {address}: {exc}"
        ) from None
    addresses = {info[4][0] for info in infos}
    # a scoped IPv6 address (fe80::1%eth0) carries its zone after '%'
    return bool(addresses) and all(
        ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses
    )


def _surely_loopback(address: str) -> bool:
    """is_loopback, with an unresolvable host counted as possibly remote."""
    try:
        return is_loopback(address)
    except UnresolvableHostError:
        return False


def mode_line(address: str, authenticated: bool, tls: bool = False) -> str:
    """What the operator should know at start: who can connect, and whether the wire is encrypted."""
    wire = "TLS" if tls else "plaintext"
    if authenticated:
        return f"tensord mode: authenticated (bearer tokens, tenants), {wire}"
    if _surely_loopback(address):
        return f"tensord mode: unauthenticated, loopback only, {wire}"
    return (
        f"tensord mode: UNAUTHENTICATED on a non-loopback address (--insecure-allow-remote), {wire}"
    )


def cleartext_warning(address: str, authenticated: bool, tls: bool) -> str | None:
    """A warning when bearer tokens would cross a network unencrypted."""
    if authenticated and not tls and not _surely_loopback(address):
        return (
            "tensord warning: bearer tokens and tensor bytes travel in clear text on "
            f"{address}; pass --tls-cert/--tls-key unless the network is trusted"
        )
    return None


def shown_address(requested: str, port: int) -> str:
    """The address clients should use: the requested host with the real port."""
    if requested.startswith("unix:"):
        return requested
    host = requested.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def apply_gil_switch_interval(seconds: float, lease_s: float | None = None) -> str | None:
    """Set this process's GIL switch interval; what is wrong with ``seconds`` (None: set).
    A lease must be at least LEASE_PER_GIL_SWITCH intervals: a heartbeat (every lease/3)
    waiting for the GIL behind busy threads waits up to one interval per thread, and must
    still land inside the lease."""
    if not 0 < seconds <= MAX_GIL_SWITCH_INTERVAL_S:  # NaN too
        return (
            f"--gil-switch-interval must be > 0 and at most {MAX_GIL_SWITCH_INTERVAL_S:g} "
            f"seconds, got {seconds:g}"
        )
    if lease_s is not None and lease_s < LEASE_PER_GIL_SWITCH * seconds:
        return (
            f"--lease ({lease_s:g} s) must be at least {LEASE_PER_GIL_SWITCH} times "
            f"--gil-switch-interval ({seconds:g} s): a heartbeat waiting for busy threads "
            f"could miss it; lower --gil-switch-interval or raise --lease"
        )
    sys.setswitchinterval(seconds)
    return None


def max_streams_problem(max_streams: int | None, max_workers: int) -> str | None:
    """What is wrong with --max-streams for --max-workers (None: nothing).  SECURITY.md's
    rule: a quarter of the workers (at least one) always stays for unary calls such as
    Heartbeat, so streams may hold at most the rest (the default)."""
    most = default_max_streams(max_workers)
    if max_streams is None or max_streams <= most:
        return None
    return (
        f"--max-streams ({max_streams}) must be at most {most} with --max-workers "
        f"{max_workers}: a quarter of the workers (at least one) stays for unary calls "
        "such as Heartbeat; raise --max-workers or lower --max-streams"
    )


def read_auth_tokens(path: str) -> dict[str, str]:
    """--auth-tokens' file; one that cannot be read says how to provide it (the Docker image's
    default command names one, which a first `docker run` has not mounted yet)."""
    try:
        return load_tokens(path)
    except OSError as exc:
        raise OSError(
            f"cannot read the --auth-tokens file {path} ({exc.strerror}): put the server's "
            "tokens there, one 'TOKEN TENANT' per line (in a container, mount it: "
            f"`docker run -v $PWD/tokens:{path}:ro ...`), or run docker-compose.yml, which "
            "serves its private network without tokens (--insecure-allow-remote)"
        ) from None


def configure_pools(
    store: TensorStore, policy: str, warm_reserve: int | None, record_history: bool
) -> None:
    """Each device's pool as ``tensord serve`` runs it: ``policy`` (--policy), the warm
    reserve (--warm-reserve; None: :func:`~tensord_server.pool.default_warm_reserve` of
    the device's capacity) and the allocator history (--record-history)."""
    for device in store.devices:
        pool = device.pool
        pool.policy = policy_named(policy)
        pool.warm_reserve = (
            default_warm_reserve(pool.capacity) if warm_reserve is None else warm_reserve
        )
        if record_history:
            pool.record_memory_history(True)


def cluster_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the cluster's flags (None: nothing)."""
    if args.cluster is None:
        if args.node_id is not None:
            return "--node-id needs --cluster"
        if args.cluster_ca is not None:
            return "--cluster-ca needs --cluster"
        return None
    if args.node_id is None:
        return "--cluster needs --node-id NAME"
    if args.address.startswith("unix:") and args.cluster_advertise is None:
        return "--cluster on a unix: socket needs --cluster-advertise HOST:PORT"
    try:
        check_node_id(args.node_id)
        parse_endpoints(args.cluster)
        lease = parse_duration(args.cluster_lease)
    except ValueError as exc:
        return str(exc)
    if lease < MIN_CLUSTER_LEASE_S:
        return f"--cluster-lease must be at least {MIN_CLUSTER_LEASE_S:g}s, got {lease:g}s"
    return node_tls_problem(args)


def node_tls_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the TLS of a cluster's node calls (None: nothing).  A node that
    serves TLS calls the others over TLS only, so it must know whom to trust; one that
    serves plaintext has no TLS to call with."""
    if args.tls_cert is not None and args.cluster_ca is None:
        return (
            "--tls-cert in a cluster needs --cluster-ca FILE: the PEM root certificates "
            "the other nodes' certificates are checked against in node-to-node calls "
            "(the CA that issued them, or for self-signed nodes their certificates)"
        )
    if args.tls_cert is None and args.cluster_ca is not None:
        return (
            "--cluster-ca needs --tls-cert/--tls-key: node calls use TLS when the nodes "
            "serve it (every node of a cluster serves TLS, or none does)"
        )
    return None


def advertised_address(args: argparse.Namespace, port: int) -> str:
    """Where other nodes' clients reach this server: --cluster-advertise, else --address
    with its real port (a wildcard host: this machine's name)."""
    if args.cluster_advertise is not None:
        return str(args.cluster_advertise)
    host = listen_host(args.address)
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def join_cluster(args: argparse.Namespace, store: TensorStore, port: int) -> ClusterNode | None:
    """Register this server in --cluster's etcd and share its name table (None without
    --cluster: etcd's client is imported only here)."""
    if args.cluster is None:
        return None
    try:
        from tensord_server.cluster.node import ClusterNode
    except ImportError as exc:
        raise RuntimeError(
            f"{exc}: install the cluster extra (pip install 'tensord[cluster]')"
        ) from None
    node = ClusterNode(
        args.node_id,
        advertised_address(args, port),
        parse_endpoints(args.cluster),
        parse_duration(args.cluster_lease),
        [(d.name, d.pool.capacity) for d in store.devices],
        tls=args.tls_cert is not None,
    )
    try:
        node.join()
    except BaseException:
        node.close()
        raise
    store.names.join(node)
    return node


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)  # observability hook
    # at the usual soft limit (1024) a few hundred idle connections leave no descriptor for
    # a new pool segment
    raise_descriptor_limit()
    try:
        loopback = is_loopback(args.address)
    except UnresolvableHostError as exc:
        print(f"tensord serve: {exc}", file=sys.stderr)
        return 2
    if args.auth_tokens is None and not loopback and not args.insecure_allow_remote:
        print(
            f"tensord serve: refusing to listen on {args.address} without --auth-tokens "
            "(pass --insecure-allow-remote to do it anyway)",
            file=sys.stderr,
        )
        return 2
    for flag in (
        "max_workers",  # else the gRPC server's own ValueError escapes as a traceback
        "max_handles_per_session",
        "max_sessions_per_tenant",
        "max_names_per_tenant",
        "max_streams",
        "max_streams_per_tenant",
        "max_op_elements",
        "max_batch_elements",
        "spill_workers",
        "restore_workers",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"tensord serve: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    problem = max_streams_problem(args.max_streams, args.max_workers)
    if problem is not None:
        print(f"tensord serve: {problem}", file=sys.stderr)
        return 2
    problem = apply_gil_switch_interval(args.gil_switch_interval, args.lease)
    if problem is not None:
        print(f"tensord serve: {problem}", file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("tensord serve: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    problem = cluster_problem(args)
    if problem is not None:
        print(f"tensord serve: {problem}", file=sys.stderr)
        return 2
    problem = serve_observability.check_arguments(args, is_loopback)  # observability hook
    if problem is not None:
        print(f"tensord serve: {problem}", file=sys.stderr)
        return 2
    try:
        credentials = (
            server_credentials(args.tls_cert, args.tls_key) if args.tls_cert is not None else None
        )
        specs = resolve_specs(args.devices, pinned_host=not args.no_pinned_host)
        tokens = read_auth_tokens(args.auth_tokens) if args.auth_tokens is not None else None
        cluster_token = (
            load_cluster_token(args.cluster_token_file, tokens)
            if args.cluster_token_file is not None and args.cluster is not None
            else None
        )
        cluster_roots = (
            read_roots(args.cluster_ca, "--cluster-ca") if args.cluster_ca is not None else None
        )
        quotas = [parse_quota(text) for text in args.quotas]
        warm_reserve = None if args.warm_reserve is None else parse_bytes(args.warm_reserve)
        host_tier = None if args.host_tier is None else parse_host_tier(args.host_tier)
        disk_tier = None if args.disk_tier is None else parse_disk_tier(args.disk_tier)
        store = TensorStore(
            specs,
            session_grace=args.session_grace,
            lease=args.lease,
            auth_tokens=tokens,
            max_handles_per_session=args.max_handles_per_session,
            max_sessions_per_tenant=args.max_sessions_per_tenant,
            max_names_per_tenant=args.max_names_per_tenant,
            quotas=quotas,
            compaction=not args.no_compaction and args.policy != "pytorch",
            max_streams=args.max_streams,
            max_streams_per_tenant=args.max_streams_per_tenant,
            stream_idle_timeout=args.stream_idle_timeout,
            share_ttl=args.share_ttl,
            max_share_ttl=args.max_share_ttl,
            max_op_elements=args.max_op_elements,
            max_batch_elements=args.max_batch_elements,
            host_tier=host_tier,
            disk_tier=disk_tier,
            spill_workers=args.spill_workers,
            restore_workers=args.restore_workers,
        )
    except (OSError, ValueError, FailedPreconditionError) as exc:
        print(f"tensord serve: {exc}", file=sys.stderr)
        return 2
    store.cluster_token = cluster_token
    store.cluster_roots = cluster_roots
    configure_pools(store, args.policy, warm_reserve, args.record_history)
    try:
        server, port = create_server(
            args.address, store=store, max_workers=args.max_workers, credentials=credentials
        )
    except (OSError, RuntimeError) as exc:
        text = str(exc)  # a failed bind's OSError names the address already
        if not text.startswith("cannot listen on "):
            text = f"cannot listen on {args.address}: {text}"
        print(f"tensord serve: {text}", file=sys.stderr)
        store.close()
        return 2
    try:
        node = join_cluster(args, store, port)
    except (OSError, RuntimeError, ConnectionError) as exc:
        print(f"tensord serve: cannot join the cluster: {exc}", file=sys.stderr)
        server.stop(None)
        store.close()
        return 2
    try:  # observability hook: the metrics and dashboard endpoints
        endpoints = serve_observability.start_endpoints(args, store)
    except (OSError, ValueError) as exc:
        print(f"tensord serve: cannot serve metrics or the dashboard: {exc}", file=sys.stderr)
        server.stop(None)
        if node is not None:
            node.close()
        store.close()
        return 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"tensord listening on {shown_address(args.address, port)}", flush=True)
    tls = credentials is not None
    print(mode_line(args.address, tokens is not None, tls), flush=True)
    warning = cleartext_warning(args.address, tokens is not None, tls)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    for name, chain in sorted(store.storages.tiers.items()):
        print(f"tensord tiers under {name}: {chain.describe()}", flush=True)
    for endpoint in endpoints:  # observability hook
        print(f"tensord http on {serve_observability.describe(endpoint, tls)}", flush=True)
    if node is not None:
        print(f"tensord node {node.node} joined {args.cluster} as {node.address}", flush=True)
    while not stop.wait(1.0):  # a timed wait keeps signal delivery prompt
        pass
    log.info("stopping: in-flight calls get %.3gs", SHUTDOWN_GRACE_S)
    if node is not None:  # first: the others stop sending this node's names' readers here
        node.close()
    server.stop(SHUTDOWN_GRACE_S).wait()
    for endpoint in endpoints:  # observability hook
        endpoint.close()
    store.close()
    return 0
