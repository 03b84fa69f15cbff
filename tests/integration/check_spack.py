#!/usr/bin/env python3
"""Loads packaging/spack/package.py without Spack (with a minimal stand-in for the part of
spack.package the recipe uses) and checks it against CMakeLists.txt: the version is the
project's, every -D option the recipe passes is an option() of the build, and every
integration target the build can make has a variant.

  check_spack.py SOURCE_DIR
"""
import os
import re
import sys
import types

src = sys.argv[1]
calls = {"version": [], "variant": [], "depends_on": [], "conflicts": []}


def recorder(name):
    return lambda *a, **k: calls[name].append((a, k))


class Spec:
    def satisfies(self, constraint):
        return constraint == "+torch"  # exercise the Torch_DIR branch too

    def __getitem__(self, name):
        pkg = types.SimpleNamespace(cmake_prefix_paths=["/prefix/lib/python3/site-packages/torch/share/cmake"])
        return types.SimpleNamespace(package=pkg)


class CMakePackage:
    spec = Spec()

    def define(self, name, value):
        return f"-D{name}={'ON' if value is True else 'OFF' if value is False else value}"

    def define_from_variant(self, name, variant):
        return f"-D{name}=<{variant}>"


stand_in = types.ModuleType("spack.package")
stand_in.CMakePackage = CMakePackage
stand_in.join_path = os.path.join
for name in calls:
    setattr(stand_in, name, recorder(name))
sys.modules["spack"] = types.ModuleType("spack")
sys.modules["spack.package"] = stand_in

namespace = {}
exec(compile(open(os.path.join(src, "packaging/spack/package.py")).read(), "package.py", "exec"), namespace)
args = namespace["Deepclone"]().cmake_args()

cmake = open(os.path.join(src, "CMakeLists.txt")).read()
cmake += open(os.path.join(src, "cmake/deepcloneIntegrations.cmake")).read()
options = set(re.findall(r"option\((\w+)", cmake))
project_version = re.search(r"project\(deepclone VERSION ([0-9.]+)", cmake).group(1)
failed = []
for a in args:
    name = re.match(r"-D(\w+)=", a).group(1)
    if name not in options and name != "Torch_DIR":
        failed.append(f"the recipe passes -D{name}, which is no option() of the build")
versions = [a[0] for a, _ in calls["version"]]
if project_version not in versions:
    failed.append(f"the recipe has versions {versions}, the project is {project_version}")
variants = {a[0] for a, _ in calls["variant"]}
targets = set(re.findall(r"add_library\(deepclone::(\w+) ALIAS", cmake)) - {"deepclone"}
variant_of = {"boost_mpi": "mpi", "thrust_cpp": "cuda"}
for t in sorted(targets):
    if variant_of.get(t, t) not in variants:
        failed.append(f"deepclone::{t} has no variant in the recipe")
for f in failed:
    print("check_spack: " + f)
if failed:
    sys.exit(1)
passed = sorted(set(re.findall(r"-D(\w+)", " ".join(args))))
print(f"check_spack: version {project_version}, options {passed}, variants {sorted(variants)} cover targets {sorted(targets)}")
