"""`--data-parallel-backend ray`: the engine replicas as Ray actors, placed by a Ray cluster.

The API server joins the Ray cluster that runs where it starts (`ray start --head` on one node,
`ray start --address=HEAD:6379` on the others; RAY_ADDRESS names another), or starts a local one,
and reserves one placement-group bundle per replica: its GPUs (--tensor-parallel-size) and a core,
or one core on CPUs. Each replica is an actor in its bundle, on whichever node has room, that runs
engine_core.run: it loads the engine and connects to the API server over the same wire and keys
as a replica in a local process. ActorProcess gives EngineClient the verbs of a process (start,
exitcode, join, kill): a replica whose actor dies is down as a process that exits is (its requests
fail at once), Ray restarts the actor (max_restarts), and its serve call is made again: the replica
loads, says ready, and the API server routes to it again.
"""
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nanoserve.server import engine_core, wire

PLACEMENT_TIMEOUT_S = 60  # how long the cluster may take to find room for every replica


class ReplicaActor:
    """A Ray worker process that serves one replica when asked, as `--headless` does."""

    def serve(self, restarted: None, *args: object) -> None:
        """engine_core.run's args; `restarted` (an ObjectRef that Ray resolves before the call)
        only orders the call after the actor's restart."""
        engine_core.run(*args, headless=True)


class ActorProcess:
    """One replica's actor, with the verbs EngineClient uses on a replica's process."""

    def __init__(self, actor: ray.actor.ActorHandle, args: tuple) -> None:
        self.actor, self.args, self.stopping = actor, args, False

    def start(self, restarted: ray.ObjectRef | None = None) -> None:
        """Ask the actor to serve (once `restarted`, a call that Ray runs when the actor is back,
        is done); the call runs until the replica stops."""
        self.serving = self.actor.serve.remote(restarted, *self.args)

    @property
    def exitcode(self) -> int | None:
        """None while the replica serves; 1 once its serve call ended (its actor died or its
        engine failed), and the call is made again: Ray runs it once the actor is back."""
        ended = bool(ray.wait([self.serving], timeout=0)[0])
        if ended and not self.stopping:  # Ray retries the no-op while the actor restarts
            self.start(self.actor.__ray_ready__.options(max_task_retries=-1).remote())
        return 1 if ended else None

    def join(self, timeout: float) -> None:
        """Wait for the replica to stop (it was told to); its actor ends with this process."""
        self.stopping = True
        ray.wait([self.serving], timeout=timeout)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


def actor_processes(size: int, local: int, model: str, settings: dict, address: str,
                    keys: wire.Keys) -> list[ActorProcess | None]:
    """The actors of replicas 0 .. local - 1, placed in the cluster's bundles and not yet
    serving (None for the others: headless ones); SystemExit naming the fix when the cluster has
    no room for them all, or has other nodes and `address` is a loopback one."""
    ray.init(log_to_driver=True)  # the cluster running here (or RAY_ADDRESS's), else a local one
    if "//127." in address and len(ray.nodes()) > 1:  # loopback: to set to this node's address
        raise SystemExit(f"other nodes cannot reach {address}: set --data-parallel-address")
    on_gpus = settings.get("device") != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
    gpus = settings.get("tensor_parallel_size", 1) if on_gpus else 0
    bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
    group = placement_group([bundle] * local)
    if not ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)[0]:
        raise SystemExit(f"the Ray cluster ({ray.cluster_resources()}) has no room for {local} "
                         f"bundles of {bundle}: add nodes or lower --data-parallel-size(-local)")
    actor = ray.remote(ReplicaActor)
    return [ActorProcess(actor.options(
        name=f"nanoserve-replica-{rank}", num_cpus=1, num_gpus=gpus, max_restarts=-1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank)).remote(),
        (address, rank, model, settings, keys.for_replicas(), None, None if gpus else 1))
        for rank in range(local)] + [None] * (size - local)
