"""Renders every kustomization under deploy/ (overlays and the Job), validates
each object against the Kubernetes schemas (kubernetes-validate, strict: no
unknown fields), and checks what kvcal relies on: the headless Service
publishes not-ready addresses, probes are gRPC, a PodDisruptionBudget, the
token Secret and a NetworkPolicy exist, requests are set, and every flag in the
rendered worker and `kvcal calibrate` args is one the binaries accept
(from their --help), and the Job reruns with a fixed --session and --resume."""
import argparse
import glob
import os
import re
import subprocess
import sys

import kubernetes_validate
import yaml

K8S_VERSION = "1.30.0"


def render(root, path):
    out = subprocess.run(["kubectl", "kustomize", path], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def accepted_flags(binary, *sub):
    text = subprocess.run([binary, *sub, "--help"], check=True, capture_output=True,
                          text=True).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", text))


def flags_of(args):
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--kvcal", required=True)
    opts = ap.parse_args()
    worker_flags = accepted_flags(opts.worker)
    calibrate_flags = accepted_flags(opts.kvcal, "calibrate")
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    targets = sorted(glob.glob(os.path.join(opts.root, "deploy/overlays/*")))
    targets += sorted(glob.glob(os.path.join(opts.root, "deploy/jobs/*")))
    check(len(targets) >= 3, f"expected the cpu and gpu overlays and a job, found {targets}")
    for target in targets:
        name = os.path.relpath(target, opts.root)
        docs = render(opts.root, target)
        kinds = {}
        for d in docs:
            kinds.setdefault(d["kind"], []).append(d)
            try:
                kubernetes_validate.validate(d, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                failures.append(f"{name}: {d['kind']}/{d['metadata']['name']}: {e.message} "
                                f"at {'/'.join(map(str, e.path))}")
        print(f"{name}: {len(docs)} objects valid against Kubernetes {K8S_VERSION}: "
              + ", ".join(f"{k}/{d['metadata']['name']}" for k, ds in kinds.items() for d in ds))
        if "/overlays/" in target:
            for kind in ("Namespace", "Service", "StatefulSet", "PodDisruptionBudget", "Secret",
                         "NetworkPolicy"):
                check(kind in kinds, f"{name}: no {kind}")
            if "Service" not in kinds or "StatefulSet" not in kinds:
                continue
            svc = kinds["Service"][0]["spec"]
            check(svc.get("clusterIP") == "None", f"{name}: the Service is not headless")
            check(svc.get("publishNotReadyAddresses") is True,
                  f"{name}: the Service needs publishNotReadyAddresses: true")
            pod = kinds["StatefulSet"][0]["spec"]["template"]["spec"]
            c = pod["containers"][0]
            flags = flags_of(c["args"])
            for f in flags:
                check(f in worker_flags, f"{name}: kvcal-worker does not accept {f}")
            check(len(flags) == len(set(flags)), f"{name}: a worker flag is given twice: {flags}")
            for f in ("--worker-id", "--state-dir", "--auth-token-file", "--listen"):
                check(f in flags, f"{name}: worker args lack {f}")
            for probe in ("readinessProbe", "livenessProbe"):
                check("grpc" in c.get(probe, {}), f"{name}: {probe} is not a gRPC probe")
            check(c.get("resources", {}).get("requests"), f"{name}: no resource requests")
            gpu = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            if name.endswith("gpu"):
                check(gpu == 1, f"{name}: no GPU limit")
                check(c["image"].endswith(":cuda"), f"{name}: not the CUDA image")
                check("--backend=cuda" in c["args"], f"{name}: backend is not cuda")
            else:
                check(gpu is None, f"{name}: asks for a GPU")
        else:
            check("Job" in kinds, f"{name}: no Job")
            for job in kinds.get("Job", []):
                c = job["spec"]["template"]["spec"]["containers"][0]
                args = c["args"]
                check(args[0] == "calibrate", f"{name}: the Job does not run kvcal calibrate")
                for f in flags_of(args[1:]):
                    check(f in calibrate_flags, f"{name}: kvcal calibrate does not accept {f}")
                check(any(a.startswith("--server=dns:///") for a in args),
                      f"{name}: the Job does not name the workers' headless Service")
                # A retried pod must continue the run, not fail on it.
                check("--resume" in args and any(a.startswith("--session=") for a in args),
                      f"{name}: the Job does not rerun with --session=ID --resume")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"worker flags checked against `{os.path.basename(opts.worker)} --help`, Job flags "
          f"against `kvcal calibrate --help`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
