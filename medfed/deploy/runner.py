"""A resident ClientApp process for one SuperNode: ``python -m medfed.deploy.runner --runtime-api-address HOST:PORT``.

Flower 1.41's SuperNode answers each message with a new ``flwr-clientapp``
process (started by its SuperExec): every message would import torch and
medfed and rebuild the hospital's site from its files. Started with
``flower-supernode --isolation process``, the SuperNode starts no process of
its own and leaves its tasks (one per message) to whoever claims them on its
Runtime API; this runner is that process. It claims the node's ClientApp
tasks one after another and answers each with medfed's ClientApp
(:mod:`medfed.deploy.client_app`) in this one process, so the imports and
the built site (modules, optimisers, data loaders, its end of the link) stay
in memory from one message to the next; the site's state folder stays the
source of truth, written after every message (a runner started again finds
it there).

It runs the medfed installed here, never code a run ships: a run whose Flower
app is not medfed's, at this version, is answered with an error.

Options: ``--runtime-api-address`` (the SuperNode's ``--host``:``--port``),
``--insecure`` or ``--root-certificates`` (the CA of the SuperNode's
``--ssl-certfile``), ``--poll-s`` (seconds between looks for a task while
idle). Bad options end with one line on stderr and exit status 2. SIGTERM or
SIGINT stops it between tasks (a task under way is finished first).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from flwr.app import Message
from flwr.app.error import Error
from flwr.app import Context
from flwr.common.constant import ErrorCode, SubStatus
from flwr.common.serde import context_from_proto, run_from_proto
from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskRequest,
    PullAppMessagesRequest,
    PullTaskInputRequest,
    SendTaskHeartbeatRequest,
)
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.inflatable.inflatable_protobuf_utils import (
    make_confirm_message_received_fn_protobuf,
    make_pull_object_fn_protobuf,
)
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.run import Run
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

import medfed
from medfed.deploy.client_app import app

FAB_ID = "medfed/medfed"
"""The Flower app id of medfed's app (``[tool.flwr.app] publisher`` / project name)."""
PULL_BACKOFF_S = 0.05
"""First wait before pulling again a message object the SuperNode does not hold yet (Flower's: 1 s)."""

log = logging.getLogger("medfed.runner")


class Runner:
    """Claims a SuperNode's ClientApp tasks and answers them in this process.

    Args:
        address: the SuperNode's Runtime API (``host:port``).
        root_certificates: the CA file that signed the Runtime API's
            certificate; None: plain HTTP (``--insecure``).
        poll_s: seconds between looks for a task while none is waiting.
    """

    def __init__(self, address: str, root_certificates: Path | None, poll_s: float) -> None:
        self.address = address
        self.root_certificates = None if root_certificates is None else str(root_certificates)
        self.poll_s = poll_s
        self.stop = threading.Event()
        self.answered = 0

    def _client(self, *interceptors: object) -> RuntimeHttpClient:
        """A Runtime API client without Flower's retries (whose give-up ends the process with SIGINT)."""
        return RuntimeHttpClient.from_server_address(
            self.address, insecure=self.root_certificates is None, root_certificates=self.root_certificates,
            interceptors=list(interceptors),
        )

    def serve(self) -> None:
        """Claim and answer tasks until :attr:`stop` is set; a SuperNode not (yet) listening is waited for."""
        client = self._client(RuntimeVersionHttpInterceptor(component_name="SuperExec"))
        request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
        unreachable_since: float | None = None
        try:
            while not self.stop.is_set():
                try:
                    claimed = client.AcquireTask(request)
                except httpx.TransportError as error:
                    if unreachable_since is None:
                        unreachable_since = time.monotonic()
                        log.warning("the SuperNode at %s does not answer (%s); waiting for it", self.address, error)
                    self.stop.wait(max(self.poll_s, 1.0))
                    continue
                if unreachable_since is not None:
                    log.info("the SuperNode at %s answers again", self.address)
                    unreachable_since = None
                if claimed.HasField("task") and claimed.token:
                    self.answer(claimed.token)
                else:
                    self.stop.wait(self.poll_s)
        finally:
            client.close()

    def answer(self, token: str) -> None:
        """One task: pull its message, run medfed's ClientApp on it, push the reply and the task's status.

        Whatever the ClientApp raises becomes the reply's Flower error (the
        server names the site and the reason), as in ``flwr-clientapp``.
        """
        client = self._client(RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token))
        heartbeat = HeartbeatSender(lambda: _heartbeat(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "the task's input could not be pulled"
        times = [time.perf_counter()]
        try:
            message, context, run = _pull_task_input(client)
            times.append(time.perf_counter())
            if run.fab_id != FAB_ID or run.fab_version != medfed.__version__:
                raise RuntimeError(
                    f"this node runs medfed {medfed.__version__} ({FAB_ID}); the run's app is {run.fab_id} {run.fab_version}"
                )
            reply = app(message=message, context=context)
            times.append(time.perf_counter())
            status, details = SubStatus.COMPLETED, ""
        except Exception as error:  # whatever the ClientApp raised goes back to the server as the reply's error
            details = f"{type(error).__name__}: {error}"
            log.error("task failed: %s", details, exc_info=not isinstance(error, RuntimeError))
            if message is not None:
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
                push_task_output(client, context, status, details)
            except httpx.HTTPError as error:
                log.error("the reply could not be pushed to the SuperNode: %s", error)
            heartbeat.stop()
            client.close()
        self.answered += 1
        steps = ", ".join(f"{name} {b - a:.2f} s" for name, a, b in zip(("pull", "app"), times, times[1:]))
        kind = "?" if message is None else message.metadata.message_type
        log.info("%s message %d answered in %.2f s (%s; %s)", kind, self.answered, time.perf_counter() - times[0], steps, status)


def _pull_task_input(client: RuntimeHttpClient) -> tuple[Message, Context, Run]:
    """The task's message, context and run (as ``flwr-clientapp`` pulls them, the app bundle left unread).

    The SuperNode offers a task before it holds all of its message's
    objects; Flower's pull waits 1 s before its first retry, this one
    :data:`PULL_BACKOFF_S` (the runner claims a task within ``poll_s``,
    where a process started per message took seconds to get there).
    """
    task_input = client.PullTaskInput(PullTaskInputRequest())
    context = context_from_proto(task_input.context)
    run = run_from_proto(task_input.run)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("the SuperNode offered a task without a message")
    node = Node(node_id=context.node_id)
    tree = pulled.message_object_trees[0]
    message = pull_and_inflate_object_from_tree(
        tree,
        make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        initial_backoff=PULL_BACKOFF_S,
        backoff_cap=1.0,
    )
    message.metadata.__dict__["_message_id"] = tree.object_id  # as flwr-clientapp: the inflated message lacks its id
    return message, context, run


def _heartbeat(client: RuntimeHttpClient) -> bool:
    """Tell the SuperNode the task is alive; False (retried later) while it cannot be reached."""
    try:
        client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
    except httpx.TransportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Parse the options, then serve until SIGTERM or SIGINT; 2 for bad options."""
    parser = argparse.ArgumentParser(prog="python -m medfed.deploy.runner", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, host:port")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--insecure", action="store_true", help="plain HTTP (the Runtime API without TLS)")
    security.add_argument("--root-certificates", type=Path, help="CA certificate of the Runtime API's TLS certificate")
    parser.add_argument("--poll-s", type=float, default=0.1, help="seconds between looks for a task while idle (default 0.1)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    host, _, port = args.runtime_api_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return _error(f"--runtime-api-address: expected host:port, got {args.runtime_api_address!r}")
    if args.root_certificates is not None and not args.root_certificates.is_file():
        return _error(f"--root-certificates: no file {args.root_certificates}")
    if not 0 < args.poll_s <= 60:
        return _error(f"--poll-s: expected seconds in (0, 60], got {args.poll_s}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s medfed runner: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    runner = Runner(args.runtime_api_address, args.root_certificates, args.poll_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop.set())
    runner.serve()
    log.info("stopped after %d messages", runner.answered)
    return 0


def _error(message: str) -> int:
    """Print ``message`` as the runner's one error line; the exit status for bad options (2)."""
    print(f"medfed runner: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
