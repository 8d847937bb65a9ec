"""An in-memory Kubernetes for the real OpenSandbox server (tests only).

`FakeK8sClient` replaces `opensandbox_server.services.k8s.client.K8sClient`: the server's
services, providers, validators and response models run unchanged on top of it. It keeps
custom objects in one process-wide `Store` (the server builds several `K8sClient`s), with
Kubernetes' semantics where the server depends on them: `uid`, `resourceVersion`,
`creationTimestamp`, label selectors, JSON merge patch (RFC 7396), 404/409 as `ApiException`,
and deletion through a finalizer (the object reads `Stopping` until its Pod is released).

`PoolController` plays the OpenSandbox pool controller and the kubelet, for pool-mode
BatchSandboxes: it allocates a Pod of the referenced Pool while the Pool has room
(`spec.capacitySpec.poolMax`), otherwise sets `PoolAllocationPending` (which the server turns
into 429 + Retry-After); after the Pool's start delay it starts the task's entrypoint as a
local process with the task's environment (a kubelet starting the container) and reports the
sandbox ready (`Succeed`) or failed (`PodFailed`). A process that exits leaves the sandbox
`Running`, as the real bootstrap does; only `fail_sandbox` (or a failed start) fails it.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import os
import shlex
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from kubernetes.client import ApiException

from opensandbox_server.services.k8s.label_selector import matches, parse_selector

GROUP = "sandbox.opensandbox.io"
VERSION = "v1alpha1"
ALLOC_STATUS = "sandbox.opensandbox.io/alloc-status"
ALLOC_FINALIZER = "pool.sandbox.opensandbox.io/pool-allocation"
BOOTSTRAP = "/opt/opensandbox/bootstrap.sh"
# Time a process gets after SIGTERM before SIGKILL when its sandbox is deleted.
STOP_GRACE_SECONDS = 5.0


def _now() -> str:
    # Kubernetes timestamps have second precision.
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: objects merge recursively, `null` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _api_error(status: int, reason: str, message: str) -> ApiException:
    error = ApiException(status=status, reason=reason)
    error.body = json.dumps({"kind": "Status", "status": "Failure", "reason": reason, "message": message, "code": status})
    return error


@dataclass
class PoolBehaviour:
    """What a test pool does with the sandboxes allocated to it."""

    # Seconds from allocation until the sandbox is ready; None holds it in Pending (the
    # create call keeps blocking) until a test changes it.
    start_delay: Optional[float] = 0.0
    # Start the task's entrypoint as a local process.
    spawn: bool = False
    # The Pod fails to start (the server answers 500 POD_FAILED and deletes the sandbox).
    fail_start: bool = False


@dataclass
class PodProcess:
    """The local process standing in for a sandbox Pod's task container."""

    name: str
    uid: str
    directory: Path
    command: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    process: Optional[subprocess.Popen] = None
    exit_code: Optional[int] = None

    def describe(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "uid": self.uid,
            "directory": str(self.directory),
            "log": str(self.directory / "log"),
            "command": self.command,
            "env": self.env,
            "pid": self.process.pid if self.process else None,
            "exit_code": self.exit_code,
        }


class Store:
    """Every object of the fake cluster, keyed by (group, version, plural, namespace, name)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.objects: Dict[tuple, Dict[str, Any]] = {}
        self._versions = itertools.count(1)
        self.changed = threading.Condition(self.lock)

    def bump(self, obj: Dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._versions))
        self.changed.notify_all()

    def create(self, key: tuple, body: Dict[str, Any]) -> Dict[str, Any]:
        with self.lock:
            if key in self.objects:
                raise _api_error(409, "AlreadyExists", f"{key[2]} {key[4]!r} already exists")
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            meta.update(name=key[4], namespace=key[3], uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            self.bump(obj)
            self.objects[key] = obj
            return copy.deepcopy(obj)

    def get(self, key: tuple) -> Optional[Dict[str, Any]]:
        with self.lock:
            obj = self.objects.get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, group: str, version: str, plural: str, namespace: Optional[str], selector: str) -> List[Dict[str, Any]]:
        terms = parse_selector(selector)
        if terms is None:
            raise _api_error(400, "BadRequest", f"unsupported label selector {selector!r}")
        with self.lock:
            return [
                copy.deepcopy(obj)
                for (g, v, p, ns, _), obj in sorted(self.objects.items())
                if (g, v, p) == (group, version, plural)
                and namespace in (None, ns)
                and matches(obj["metadata"].get("labels") or {}, terms)
            ]

    def patch(self, key: tuple, body: Dict[str, Any]) -> Dict[str, Any]:
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                raise _api_error(404, "NotFound", f"{key[2]} {key[4]!r} not found")
            patched = merge_patch(obj, body)
            # Identity fields are the server's, whatever the patch says.
            for name in ("name", "namespace", "uid", "creationTimestamp"):
                patched["metadata"][name] = obj["metadata"][name]
            self.bump(patched)
            self.objects[key] = patched
            return copy.deepcopy(patched)

    def update(self, key: tuple, change: Callable[[Dict[str, Any]], None]) -> None:
        """Applies `change` to the stored object in place (controller-side writes)."""
        with self.lock:
            obj = self.objects.get(key)
            if obj is not None:
                change(obj)
                self.bump(obj)

    def delete(self, key: tuple) -> None:
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                raise _api_error(404, "NotFound", f"{key[2]} {key[4]!r} not found")
            if obj["metadata"].get("finalizers"):
                # Kubernetes keeps the object until its finalizers are removed.
                if not obj["metadata"].get("deletionTimestamp"):
                    obj["metadata"]["deletionTimestamp"] = _now()
                    self.bump(obj)
            else:
                del self.objects[key]
                self.changed.notify_all()


STORE = Store()


class FakeK8sClient:
    """The subset of `K8sClient` the server calls in Kubernetes mode with BatchSandboxes."""

    def __init__(self, k8s_config: Any = None) -> None:
        self.config = k8s_config

    @staticmethod
    def _key(group: str, version: str, plural: str, namespace: str, name: str) -> tuple:
        return (group, version, plural, namespace, name)

    def create_custom_object(self, group, version, namespace, plural, body):
        name = (body.get("metadata") or {}).get("name")
        return STORE.create(self._key(group, version, plural, namespace, name), body)

    def get_custom_object(self, group, version, namespace, plural, name):
        return STORE.get(self._key(group, version, plural, namespace, name))

    def list_custom_objects(self, group, version, namespace, plural, label_selector="", ignore_not_found=True):
        return STORE.list(group, version, plural, namespace, label_selector)

    def list_custom_objects_all_namespaces(self, group, version, plural, label_selector=""):
        return STORE.list(group, version, plural, None, label_selector)

    def patch_custom_object(self, group, version, namespace, plural, name, body):
        return STORE.patch(self._key(group, version, plural, namespace, name), body)

    def delete_custom_object(self, group, version, namespace, plural, name, grace_period_seconds=0):
        STORE.delete(self._key(group, version, plural, namespace, name))

    def custom_resource_exists(self, group, version, plural):
        return group == GROUP

    # No informers: the server then polls (`sandbox_create_poll_interval_seconds`).
    def subscribe_custom_objects(self, *args, **kwargs):
        return None

    def watch_custom_objects(self, *args, **kwargs):
        return None

    def invalidate_custom_objects(self, *args, **kwargs):
        return None

    def stop_informers(self):
        return None

    # Pods are modelled by the pool controller, not as API objects; the server lists them
    # only for platform-constraint diagnostics.
    def list_pods(self, namespace, label_selector=""):
        return []

    def read_pod(self, namespace, name):
        return None

    def get_pvc(self, namespace, name):
        return None

    def list_pvcs(self, namespace, label_selector=""):
        return []

    def delete_pvc(self, namespace, name):
        return None

    def __getattr__(self, name):
        # Anything else (PVC and Secret writes, raw API handles) is outside what the tests
        # exercise; fail loudly instead of pretending.
        raise NotImplementedError(f"FakeK8sClient.{name} is not modelled by the test harness")


class PoolController:
    """Allocates pool Pods to pool-mode BatchSandboxes and runs their entrypoints."""

    def __init__(self, namespace: str, workdir: Path) -> None:
        self.namespace = namespace
        self.workdir = workdir
        self.behaviour: Dict[str, PoolBehaviour] = {}
        # Sandbox name -> its Pod, while allocated.
        self.pods: Dict[str, PodProcess] = {}
        # Sandbox name -> monotonic time at which it becomes ready.
        self.ready_at: Dict[str, float] = {}
        # Sandboxes whose Pod is being stopped after deletion.
        self.releasing: set = set()
        self._pod_numbers = itertools.count(1)
        self._stopping = False

    def _key(self, plural: str, name: str) -> tuple:
        return (GROUP, VERSION, plural, self.namespace, name)

    # -- test controls -------------------------------------------------------------------

    def put_pool(self, name: str, capacity: int, behaviour: PoolBehaviour) -> None:
        with STORE.lock:
            key = self._key("pools", name)
            capacity_spec = {"bufferMax": 0, "bufferMin": 0, "poolMax": capacity, "poolMin": 0}
            if STORE.get(key) is None:
                STORE.create(key, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Pool", "metadata": {"name": name}, "spec": {"capacitySpec": capacity_spec}})
            else:
                STORE.patch(key, {"spec": {"capacitySpec": capacity_spec}})
            self.behaviour[name] = behaviour
            # A new start delay applies to sandboxes still starting.
            for sandbox in self._starting_in(name):
                self._schedule_ready(sandbox, behaviour)
            STORE.changed.notify_all()

    def delete_pool(self, name: str) -> None:
        try:
            STORE.delete(self._key("pools", name))
        except ApiException:
            pass
        self.behaviour.pop(name, None)

    def fail_sandbox(self, name: str) -> bool:
        """The sandbox's task failed (the server then reports `Failed`, `TASK_FAILED`)."""
        found = STORE.get(self._key("batchsandboxes", name)) is not None
        STORE.update(self._key("batchsandboxes", name), lambda obj: obj.setdefault("status", {}).update(taskFailed=1))
        return found

    def describe(self, name: str) -> Optional[Dict[str, Any]]:
        obj = STORE.get(self._key("batchsandboxes", name))
        if obj is None:
            return None
        with STORE.lock:
            pod = self.pods.get(name)
            return {"batchsandbox": obj, "pod": pod.describe() if pod else None}

    def describe_all(self, pool: Optional[str]) -> List[Dict[str, Any]]:
        with STORE.lock:
            names = [
                key[4]
                for key, obj in sorted(STORE.objects.items())
                if key[:4] == (GROUP, VERSION, "batchsandboxes", self.namespace)
                and pool in (None, obj["spec"].get("poolRef"))
            ]
            return [d for d in (self.describe(n) for n in names) if d is not None]

    # -- the controller loop -------------------------------------------------------------

    def _starting_in(self, pool: str):
        for sandbox in list(self.ready_at):
            obj = STORE.objects.get(self._key("batchsandboxes", sandbox))
            if obj is not None and obj["spec"].get("poolRef") == pool:
                yield sandbox

    def _schedule_ready(self, sandbox: str, behaviour: PoolBehaviour) -> None:
        self.ready_at[sandbox] = float("inf") if behaviour.start_delay is None else time.monotonic() + behaviour.start_delay

    def run(self) -> None:
        while not self._stopping:
            with STORE.lock:
                self._reconcile()
                STORE.changed.wait(timeout=0.05)

    def stop(self) -> None:
        self._stopping = True
        for pod in list(self.pods.values()):
            self._kill(pod)

    def _reconcile(self) -> None:
        for key, obj in list(STORE.objects.items()):
            if key[:3] != (GROUP, VERSION, "batchsandboxes") or key[3] != self.namespace:
                continue
            name, pool = key[4], obj["spec"].get("poolRef")
            if not pool:
                continue
            if obj["metadata"].get("deletionTimestamp"):
                self._release(name, key)
            elif name not in self.pods:
                self._allocate(name, key, obj, pool)
            elif name in self.ready_at and time.monotonic() >= self.ready_at[name]:
                self._start(name, key, obj, pool)

    def _used(self, pool: str) -> int:
        return sum(1 for sandbox in self.pods if (STORE.objects.get(self._key("batchsandboxes", sandbox)) or {}).get("spec", {}).get("poolRef") == pool)

    def _allocate(self, name: str, key: tuple, obj: Dict[str, Any], pool: str) -> None:
        pool_obj = STORE.objects.get(self._key("pools", pool))
        behaviour = self.behaviour.get(pool, PoolBehaviour())
        capacity = (pool_obj or {}).get("spec", {}).get("capacitySpec", {}).get("poolMax", 0)
        if pool_obj is None or self._used(pool) >= capacity:
            conditions = obj.get("status", {}).get("conditions", [])
            if not any(c.get("type") == "PoolAllocationPending" for c in conditions):
                pending = {"type": "PoolAllocationPending", "status": "True", "message": f"Pool {pool} has no free capacity"}
                STORE.update(key, lambda o: o.setdefault("status", {}).setdefault("conditions", []).append(pending))
            return
        pod = PodProcess(name=f"{pool}-{next(self._pod_numbers)}", uid=str(uuid.uuid4()), directory=self.workdir / "pods" / name)
        self.pods[name] = pod
        self._schedule_ready(name, behaviour)

        def allocated(o: Dict[str, Any]) -> None:
            o["metadata"].setdefault("annotations", {})[ALLOC_STATUS] = json.dumps({"pods": [pod.name], "poolRef": pool})
            o["metadata"].setdefault("finalizers", []).append(ALLOC_FINALIZER)
            status = o.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions", []) if c.get("type") != "PoolAllocationPending"]
            status.update(replicas=1, allocated=1, ready=0)

        STORE.update(key, allocated)

    def _start(self, name: str, key: tuple, obj: Dict[str, Any], pool: str) -> None:
        del self.ready_at[name]
        behaviour = self.behaviour.get(pool, PoolBehaviour())
        pod = self.pods[name]
        if behaviour.fail_start:
            failed = {"type": "PodFailed", "status": "True", "message": f"pod {pod.name} failed to start (test pool {pool} is set to fail)"}
            STORE.update(key, lambda o: o.setdefault("status", {}).update(phase="Failed", conditions=[failed]))
            return
        if behaviour.spawn:
            self._spawn(pod, obj)

        def ready(o: Dict[str, Any]) -> None:
            o["metadata"].setdefault("annotations", {})["sandbox.opensandbox.io/endpoints"] = json.dumps(["127.0.0.1"])
            o.setdefault("status", {}).update(ready=1, phase="Succeed")

        STORE.update(key, ready)

    def _spawn(self, pod: PodProcess, obj: Dict[str, Any]) -> None:
        process = obj["spec"].get("taskTemplate", {}).get("spec", {}).get("process", {})
        command = list(process.get("command") or [])
        # The server wraps the entrypoint as `sh -c "exec bootstrap.sh <entrypoint…>"`; the
        # bootstrap (execd) is not here, so run the entrypoint it would exec.
        if command[:2] == ["/bin/sh", "-c"] and len(command) == 3:
            words = shlex.split(command[2])
            if words[:2] == ["exec", BOOTSTRAP]:
                command = words[2:]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(pod.directory)}
        env.update({item["name"]: item.get("value") or "" for item in process.get("env") or []})
        pod.command, pod.env = command, env
        pod.directory.mkdir(parents=True, exist_ok=True)
        with open(pod.directory / "log", "ab") as log:
            try:
                pod.process = subprocess.Popen(command, env=env, cwd=pod.directory, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as error:
                log.write(f"cannot start {command!r}: {error}\n".encode())
                pod.exit_code = 127
                return
        threading.Thread(target=self._reap, args=(pod,), daemon=True).start()

    def _reap(self, pod: PodProcess) -> None:
        code = pod.process.wait()
        with STORE.lock:
            pod.exit_code = code
            STORE.changed.notify_all()

    def _kill(self, pod: PodProcess) -> None:
        if pod.process is None or pod.process.poll() is not None:
            return
        try:
            os.killpg(pod.process.pid, signal.SIGTERM)
            pod.process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(pod.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _release(self, name: str, key: tuple) -> None:
        if name in self.releasing:
            return
        self.releasing.add(name)
        pod = self.pods.get(name)
        self.ready_at.pop(name, None)

        def release() -> None:
            # A process may take its grace period to exit; the API keeps answering
            # meanwhile and the sandbox reads `Stopping`.
            if pod is not None:
                self._kill(pod)
            with STORE.lock:
                self.pods.pop(name, None)
                self.releasing.discard(name)
                STORE.objects.pop(key, None)
                STORE.changed.notify_all()

        threading.Thread(target=release, daemon=True).start()
