# Spack recipe for deepclone (header-only C++20). deepclone has no public download yet, so
# the source is a local checkout, in a Spack environment:
#   spack repo create myrepo && mkdir -p myrepo/packages/deepclone
#   cp packaging/spack/package.py myrepo/packages/deepclone/ && spack repo add myrepo
#   spack env activate -d . && spack add deepclone@0.1.0+mpi
#   spack develop --path /path/to/deepclone deepclone@0.1.0 && spack install
# Then find_package(deepclone) in that environment finds it, with the integration targets of
# the variants that were enabled (deepclone::boost_mpi, deepclone::torch, ...).
# tests/integration/check_spack.py checks that every CMake option it passes exists.

from spack.package import *


class Deepclone(CMakePackage):
    """Fork a live data-parallel deep-learning training job into new ranks while the
    sources keep training. Header-only; the integrations are opt-in."""

    version("0.1.0")  # the version in CMakeLists.txt; sources through `spack develop`

    variant("mpi", default=True, description="Boost.MPI communicator adapter (deepclone::boost_mpi)")
    variant("fmt", default=False, description="fmt formatters (deepclone::fmt)")
    variant("xxhash", default=False, description="XXH3 checksum policy (deepclone::xxhash)")
    variant("json", default=False, description="Reports as JSON through nlohmann-json (deepclone::json)")
    variant("torch", default=False, description="LibTorch tensors and modules (deepclone::torch)")
    variant("cuda", default=False, description="CUDA device staging (deepclone::cuda)")

    depends_on("cmake@3.21:", type="build")
    depends_on("mpi", when="+mpi")
    depends_on("boost@1.70:+mpi+serialization", when="+mpi")
    depends_on("fmt", when="+fmt")
    depends_on("xxhash", when="+xxhash")
    depends_on("nlohmann-json@3.2:", when="+json")
    depends_on("py-torch", when="+torch")
    depends_on("cuda", when="+cuda")
    depends_on("thrust", when="+cuda")
    conflicts("%gcc@:11", msg="deepclone needs g++ 12 or newer (C++20)")
    conflicts("%clang@:13", msg="deepclone needs clang 14 or newer (C++20)")

    def cmake_args(self):
        # The integrations are found by their packages' CMake configs; none is required.
        # Tests, examples and benchmarks are for deepclone's own development.
        args = [
            self.define("DEEPCLONE_BUILD_TESTS", False),
            self.define("DEEPCLONE_BUILD_EXAMPLES", False),
            self.define("DEEPCLONE_BUILD_BENCH", False),
            self.define("DEEPCLONE_INSTALL", True),
            self.define_from_variant("DEEPCLONE_CUDA", "cuda"),
        ]
        if self.spec.satisfies("+torch"):
            # py-torch installs LibTorch's CMake config inside its Python package.
            args.append(self.define("Torch_DIR", join_path(self.spec["py-torch"].package.cmake_prefix_paths[0], "Torch")))
        return args
