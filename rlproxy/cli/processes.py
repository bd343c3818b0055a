"""The processes the long commands run: `serve` (uvicorn), the trainer process, torchrun's ranks,
`sft` and `fork`. Each builds its parts through the composition root (`rlproxy/compose.py`) and runs
them until it is stopped; `rlproxy/cli/main.py` parses the options and calls one of these.

    rlproxy serve | dashboard   serve(settings)              build_app / build_readonly_app under uvicorn
    rlproxy train               run_trainer(settings)        the trainer alone, publishing to --upstream
    rlproxy train --nproc N     launch_trainer(settings)     N ranks under torchrun, each train_worker()
    rlproxy sft                 run_sft(settings, policy)    one SFT step (trainer/offline.py)
    rlproxy fork                fork(settings, src, new)     a new policy from a step (trainer/offline.py)
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from rlproxy.compose import build_app, build_readonly_app, init_adapter, make_backend, make_trainer
from rlproxy.errors import TrainerError
from rlproxy.inference.models import resolve_model
from rlproxy.logsetup import quiet_third_party
from rlproxy.proxy import server as http_server
from rlproxy.settings import Settings
from rlproxy.storage import db
from rlproxy.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

# The embedded engine and the trainer's modules load torch (seconds, and memory): they are imported
# where they are built (`# lazy: torch`), so a process that needs neither never loads it.


async def run_sft(settings: Settings, policy: str, **options: Any) -> dict[str, Any]:
    """What `rlproxy sft` runs: one SFT step of `policy` (trainer/offline.py), loaded into
    `settings.upstream` when given (a running `serve` on the store picks it up either way)."""
    from rlproxy.trainer.offline import run_sft as sft_step  # lazy: torch

    url = db.normalize_url(settings.db_url)
    await db.upgrade_async(url)
    backend = make_backend(settings) if settings.upstream else None  # attached: VLLMBackend
    if backend is not None:
        await backend.start()
    try:
        model_path = (
            backend.model_path
            if backend is not None
            else resolve_model(settings.model, cache_dir=settings.cache_dir)
        )
        file = options.pop("file", None)
        return await sft_step(
            url,
            settings.group(TrainerConfig),
            str(model_path),
            policy,
            file=str(file) if file else None,
            backend=backend,
            **options,
        )
    finally:
        if backend is not None:
            await backend.stop()


async def fork(settings: Settings, source: str, new_policy: str) -> Any:
    """What `rlproxy fork POLICY@N NEW` runs (trainer/offline.py); a running `serve` loads it by polling."""
    from rlproxy.trainer.offline import fork_policy  # lazy: torch

    url = db.normalize_url(settings.db_url)
    await db.upgrade_async(url)
    return await fork_policy(url, settings.group(TrainerConfig), source, new_policy)


def _raise_open_files(wanted: int) -> None:
    """Raise the soft open-files limit toward `wanted` (at most the hard one): the cap binds, not EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def serve(
    settings: Settings,
    *,
    readonly: bool = False,
    access_log: bool = True,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
) -> bool:
    """Serve `build_app(settings)` (or `build_readonly_app` for `rlproxy dashboard`) until stopped.

    `on_ready(base)` is called once it listens (`base`: http://host:port, loopback when bound to
    every address). Returns False when it never started (the lifespan failed; the log says why).
    """
    _raise_open_files(settings.max_connections + 256)  # each connection is a file descriptor
    application = _StartupError(build_readonly_app(settings) if readonly else build_app(settings))
    config = http_server.config(application, settings, access_log=access_log, log_level=log_level)
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started and on_ready is not None:
        port = server.servers[0].sockets[0].getsockname()[1]
        host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        on_ready(f"http://{host}:{port}")
    await task
    if application.error is not None:  # the command line says it in one line (cli/options.py)
        raise StartupFailed(application.error) from application.error
    return bool(server.started)


class StartupFailed(Exception):
    """`serve` never started: the lifespan raised `cause` (a model, a database, a port...)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _StartupError:
    """The app, keeping the exception its lifespan raised on start instead of letting uvicorn log
    its traceback (Starlette sends it as the failure message); `serve` raises it afterwards."""

    def __init__(self, app: Any) -> None:
        self.app, self.error = app, None
        self.state = getattr(app, "state", None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)
        started = False

        async def quiet_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "lifespan.startup.complete"
            if message["type"] == "lifespan.startup.failed":
                message = {"type": message["type"], "message": ""}
            await send(message)

        try:
            await self.app(scope, receive, quiet_send)
        except Exception as exc:
            if started:
                raise
            self.error = exc


class _Server(uvicorn.Server):
    """uvicorn's server, whose failed start ends `serve()` quietly instead of `sys.exit(3)` inside a
    task (which asyncio reports as "Task exception was never retrieved ... SystemExit: 3")."""

    async def startup(self, sockets: Any = None) -> None:
        said = logging.getLogger("uvicorn.error")
        said.addFilter(_no_exiting)  # "Application startup failed. Exiting.": serve says why instead
        try:
            await super().startup(sockets=sockets)
        except SystemExit:
            self.should_exit = True
        finally:
            said.removeFilter(_no_exiting)


def _no_exiting(record: logging.LogRecord) -> bool:
    return record.getMessage() != "Application startup failed. Exiting."


async def run_trainer(settings: Settings, ranks: Any = None) -> None:
    """What `rlproxy train` runs: the trainer alone, publishing to `settings.upstream`, until SIGTERM.

    With `ranks` (rank 0 of a `--nproc N` job, trainer/distributed.py) each step runs on every rank,
    and stopping tells the other ranks to exit.
    """
    await db.upgrade_async(db.normalize_url(settings.db_url))
    backend = make_backend(settings)  # attached to `settings.upstream` (the command requires it)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    from rlproxy.trainer.distributed import Leader  # lazy: torch

    leader = Leader(ranks) if ranks is not None else None
    try:
        await backend.start()
        if leader is not None:
            leader.model_path = backend.model_path  # the base model the ranks load, as rank 0 does
        if settings.init_adapter:
            await init_adapter(settings, backend, backend.served_model)
        # canary rollouts are judged where the trainer runs
        service = make_trainer(settings, backend, train_fn=leader.train_step if leader is not None else None)
        try:
            await service.start()
            logger.info("trainer running against %s; SIGTERM to stop", settings.upstream)
            await stop.wait()
        finally:
            await service.stop()
    finally:
        if leader is not None:  # after the service: no step in flight; the other ranks wait for a command
            await asyncio.to_thread(leader.stop)
        await backend.stop()


# The ranks of `rlproxy train --nproc N` read the resolved settings here (JSON), not from their argv.
TRAIN_JOB_ENV = "RLPROXY_TRAIN_JOB_SETTINGS"
WORKER_CODE = "from rlproxy.cli.processes import train_worker; train_worker()"


def launch_trainer(settings: Settings) -> None:
    """`rlproxy train --nproc N`: N ranks on this machine under torchrun's elastic agent (this process).

    The agent starts the ranks, and when one dies tears the others down and returns (max_restarts 0):
    the job ends with a TrainerError naming the rank; starting it again resumes from the newest
    checkpoint (trainer/distributed.py). SIGTERM reaches every rank: rank 0 finishes its step, then
    tells the others to exit (the agent kills what is left after 30 s; crash-safe either way).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[TRAIN_JOB_ENV] = settings.model_dump_json()
    args = parse_args(
        [
            "--standalone",  # one machine; a free rendezvous port on loopback
            f"--nproc-per-node={settings.nproc}",
            "--max-restarts=0",
            "--no-python",
            sys.executable,
            "-c",
            WORKER_CODE,
        ]
    )
    logger.info("starting %d trainer rank(s) with torch.distributed.run", settings.nproc)
    try:
        run(args)
    except SignalException as exc:  # SIGTERM / Ctrl-C: the agent passed it on, the ranks have stopped
        logger.info("training job stopped (%s)", exc)
    except ChildFailedError as exc:
        failures = "; ".join(
            f"rank {rank} exit {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
            for rank, f in sorted(exc.failures.items())
        )
        raise TrainerError(
            f"the training job stopped: {failures}. Start it again: it resumes from the newest checkpoint "
            "and commits a step saved but not committed exactly once"
        ) from None
    finally:
        os.environ.pop(TRAIN_JOB_ENV, None)


def train_worker() -> None:
    """One rank of `rlproxy train --nproc N` (started by `launch_trainer`): rank 0 runs the trainer
    service, the others follow its steps."""
    from rlproxy.trainer import distributed  # lazy: torch

    settings = Settings.model_validate_json(os.environ[TRAIN_JOB_ENV])
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    quiet_third_party("info")
    ranks = distributed.init()
    try:
        if ranks.leader:
            asyncio.run(run_trainer(settings, ranks))
        else:
            distributed.follow(ranks, settings.group(TrainerConfig))
    finally:
        distributed.shutdown()
