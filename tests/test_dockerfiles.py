"""The images' Dockerfiles parse, and every base image and key component is pinned to a version.

Docker cannot build here; `dockerfile-parse` reads the files as Docker would (instructions, ARG
defaults, FROM after ARG substitution).
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from dockerfile_parse import DockerfileParser

DOCKER = Path(__file__).resolve().parents[1] / "docker"
PINNED_IMAGE = re.compile(r"^[\w./-]+(:[\w][\w.-]*|@sha256:[0-9a-f]{64})$")


def parse(name: str, **build_args: str) -> DockerfileParser:
    parser = DockerfileParser(fileobj=(DOCKER / name).open("rb"), build_args=build_args)
    assert parser.structure, name
    return parser


def args_of(parser: DockerfileParser) -> dict[str, str]:
    return {k: v for k, v in (i["value"].split("=", 1) for i in parser.structure
                              if i["instruction"] == "ARG" and "=" in i["value"])}


def runs(parser: DockerfileParser) -> str:
    return "\n".join(i["value"] for i in parser.structure if i["instruction"] == "RUN")


def test_base_images_are_pinned():
    base = parse("a4ray.Dockerfile")
    assert base.baseimage == "nvcr.io/nvidia/pytorch:25.12-py3"
    for name in ("pai.Dockerfile", "deepep.Dockerfile"):
        variant = parse(name, BASE_IMAGE="us-docker.pkg.dev/p/r/a4ray:25.12-ray2.60.0")
        assert variant.baseimage == "us-docker.pkg.dev/p/r/a4ray:25.12-ray2.60.0"
        assert args_of(variant)["BASE_IMAGE"] == "a4ray:25.12-ray2.60.0"
    for name in ("a4ray.Dockerfile", "pai.Dockerfile", "deepep.Dockerfile"):
        for image in parse(name).parent_images:
            resolved = image.replace("${BASE_IMAGE}", args_of(parse(name)).get("BASE_IMAGE", ""))
            assert PINNED_IMAGE.match(resolved) and not resolved.endswith(":latest"), (name, image)


def test_key_versions_are_pinned_and_nothing_is_sloppy():
    base = parse("a4ray.Dockerfile")
    assert args_of(base) == {"RAY_VERSION": "2.60.0", "NCCL_TESTS_VERSION": "v2.17.6",
                             "NCCL_TESTS_COMMIT": "da0b547b1b9c6e3b1d4c15578087874522ae3761", "PY_SPY_VERSION": "0.4.1"}
    assert '"ray[default]==${RAY_VERSION}"' in runs(base) and "MPI=1" in runs(base)
    assert "rev-parse HEAD)\" = \"${NCCL_TESTS_COMMIT}\"" in runs(base)
    pai = parse("pai.Dockerfile")
    assert args_of(pai)["PAI_MEGATRON_PATCH_COMMIT"] == "a098ca5acbdeaf7172ce0393fa309b39a77506db"
    deepep = parse("deepep.Dockerfile")
    assert args_of(deepep)["NVSHMEM_VERSION"] == "v3.5.19-1"
    assert args_of(deepep)["DEEPEP_COMMIT"].startswith("8a07e7e")
    assert "-DNVSHMEM_IBGDA_SUPPORT=ON" in runs(deepep) and "-DCMAKE_CUDA_ARCHITECTURES=100" in runs(deepep)
    for parser in (base, pai, deepep):
        text = runs(parser)
        # Every pip requirement names an exact version (or a local path); nothing fails silently.
        for req in re.findall(r'"([A-Za-z0-9_.\[\]-]+(?:[=<>!~]=?[^"]*)?)"', text):
            if re.match(r"^[A-Za-z]", req) and not req.startswith(("import", "torch==")):
                assert "==" in req, f"unpinned pip requirement {req!r}"
        assert "|| true" not in text and "sed -i" not in text
        instructions = " ".join(i["value"] for i in parser.structure if i["instruction"] != "COMMENT")
        assert not re.search(r"sshd|openssh|ssh-keygen|authorized_keys", instructions)
    assert "git checkout --detach \"${PAI_MEGATRON_PATCH_COMMIT}\"" in runs(pai)


def test_cloudbuild_builds_the_three_images():
    build = yaml.safe_load((DOCKER / "cloudbuild.yml").read_text())
    dockerfiles = [a.split("=", 1)[1] for step in build["steps"] for a in step["args"] if a.startswith("--file=")]
    assert dockerfiles == ["docker/a4ray.Dockerfile", "docker/pai.Dockerfile", "docker/deepep.Dockerfile"]
    assert len(build["images"]) == 3 and all("${_TAG}" in image for image in build["images"])
    assert all(f.exists() for f in (DOCKER.parent / d for d in dockerfiles))
