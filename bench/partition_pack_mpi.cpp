// partition_pack_mpi: how a non-contiguous intersection of partitioned state is best moved over
// MPI (issue 12 item 3). Rank 0 holds a row-major float matrix, rank 1 wants a column block of
// it in its own matrix of the same shape (both sides strided: a tensor-parallel column split
// meeting a replicated or differently split tensor). Three ways, plus a floor:
//   pack      the sender copies the block's rows into one buffer, one MPI_Send, the receiver
//             copies them out (what partition_groups.hpp's pack/unpack do);
//   pack-1M   the same in messages of whole runs up to 1 MiB: the receiver unpacks one while
//             the sender packs the next (a pipeline);
//   subarray  MPI_Type_create_subarray on both sides, one send/recv straight between matrices;
//   hindexed  MPI_Type_create_hindexed over the runs' absolute addresses (MPI_BOTTOM), built,
//             committed and freed inside the timing on each side: what a group of runs from
//             several tensors would be sent as, the subarray's generalisation;
//   per-run   one message per row of the block (MPI_Isend/MPI_Irecv, all posted at once), what
//             the plan's region_transfers would be sent as without grouping;
//   contig    the same bytes as one message from and into contiguous buffers, no copy on
//             either side (the floor: what no strided way can beat).
// Each timing is from the sender's start until it receives the receiver's 0-byte ack sent after
// the last byte is in place; buffers are pre-faulted; the median (min-max) of --reps repetitions.
// Every repetition checks every byte of the receiver's matrix: the block equals the sender's,
// the rest is untouched.
//
// One message per run is skipped above 65536 runs: with 262144 runs of 64 B one repetition took
// 81 s (Open MPI 4.1, shared memory), against 12-72 ms for the others.
//
//   mpirun -np 2 [--allow-run-as-root] [--oversubscribe] partition_pack_mpi [--reps 7]
#define OMPI_SKIP_MPICXX 1  // the C API only: Open MPI's C++ bindings warn under -Wextra
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct box_case {
  std::uint64_t rows, cols, col0, ncols;  ///< matrix rows x cols (floats), block columns [col0, col0 + ncols)
  std::uint64_t run_bytes() const { return ncols * sizeof(float); }
  std::uint64_t bytes() const { return rows * run_bytes(); }
};

enum class way { pack, pack_chunked, subarray, hindexed, per_run, contig };
constexpr std::uint64_t chunk_bytes = 1 << 20;
constexpr std::uint64_t max_per_run_messages = 65536;
const char* way_name(way w) {
  switch (w) {
    case way::pack: return "pack";
    case way::pack_chunked: return "pack-1M";
    case way::subarray: return "subarray";
    case way::hindexed: return "hindexed";
    case way::per_run: return "per-run";
    case way::contig: return "contig";
  }
  return "?";
}

/// The buffers of one case on one rank, allocated and pre-faulted once.
struct buffers {
  std::vector<float> matrix;       ///< the rank's own rows x cols tensor
  std::vector<std::byte> packed;   ///< the pack buffer (and the contiguous floor's message)
  MPI_Datatype block = MPI_DATATYPE_NULL;
};

float value_at(std::uint64_t r, std::uint64_t c, int rep) { return static_cast<float>((r * 131 + c * 7 + rep) % 1000003); }

buffers make_buffers(const box_case& k) {
  buffers b;
  b.matrix.assign(k.rows * k.cols, 0.0f);  // assign writes every page: pre-faulted
  b.packed.assign(k.bytes(), std::byte{1});
  const int sizes[2] = {static_cast<int>(k.rows), static_cast<int>(k.cols)};
  const int sub[2] = {static_cast<int>(k.rows), static_cast<int>(k.ncols)};
  const int start[2] = {0, static_cast<int>(k.col0)};
  MPI_Type_create_subarray(2, sizes, sub, start, MPI_ORDER_C, MPI_FLOAT, &b.block);
  MPI_Type_commit(&b.block);
  return b;
}

/// Rows [first, last) of the block, packed at their place in the whole block's buffer.
void pack_rows(const box_case& k, const float* m, std::byte* out, std::uint64_t first = 0, std::uint64_t last = ~0ull) {
  for (std::uint64_t r = first; r < std::min(last, k.rows); ++r)
    std::memcpy(out + r * k.run_bytes(), m + r * k.cols + k.col0, k.run_bytes());
}
void unpack_rows(const box_case& k, const std::byte* in, float* m, std::uint64_t first = 0, std::uint64_t last = ~0ull) {
  for (std::uint64_t r = first; r < std::min(last, k.rows); ++r)
    std::memcpy(m + r * k.cols + k.col0, in + r * k.run_bytes(), k.run_bytes());
}
/// Rows per message of pack-1M: whole runs, at least one.
std::uint64_t rows_per_chunk(const box_case& k) { return std::max<std::uint64_t>(1, chunk_bytes / k.run_bytes()); }
std::uint64_t chunks(const box_case& k) { return (k.rows + rows_per_chunk(k) - 1) / rows_per_chunk(k); }

void send_chunked(const box_case& k, buffers& b) {
  const auto per = rows_per_chunk(k);
  std::vector<MPI_Request> req(chunks(k));
  for (std::uint64_t i = 0; i < req.size(); ++i) {
    const auto first = i * per, n = std::min(per, k.rows - first);
    pack_rows(k, b.matrix.data(), b.packed.data(), first, first + n);
    MPI_Isend(b.packed.data() + first * k.run_bytes(), static_cast<int>(n * k.run_bytes()), MPI_BYTE, 1, 1, MPI_COMM_WORLD, &req[i]);
  }
  MPI_Waitall(static_cast<int>(req.size()), req.data(), MPI_STATUSES_IGNORE);
}
void receive_chunked(const box_case& k, buffers& b) {
  const auto per = rows_per_chunk(k);
  std::vector<MPI_Request> req(chunks(k));
  for (std::uint64_t i = 0; i < req.size(); ++i) {
    const auto first = i * per, n = std::min(per, k.rows - first);
    MPI_Irecv(b.packed.data() + first * k.run_bytes(), static_cast<int>(n * k.run_bytes()), MPI_BYTE, 0, 1, MPI_COMM_WORLD, &req[i]);
  }
  for (std::uint64_t i = 0; i < req.size(); ++i) {  // in order: unpack each as it lands
    MPI_Wait(&req[i], MPI_STATUS_IGNORE);
    unpack_rows(k, b.packed.data(), b.matrix.data(), i * per, (i + 1) * per);
  }
}

/// The block's rows in `m` as one datatype of absolute addresses (MPI_BOTTOM based).
MPI_Datatype rows_type(const box_case& k, float* m) {
  std::vector<int> len(k.rows, static_cast<int>(k.run_bytes()));
  std::vector<MPI_Aint> at(k.rows);
  for (std::uint64_t r = 0; r < k.rows; ++r) MPI_Get_address(m + r * k.cols + k.col0, &at[r]);
  MPI_Datatype t;
  MPI_Type_create_hindexed(static_cast<int>(k.rows), len.data(), at.data(), MPI_BYTE, &t);
  MPI_Type_commit(&t);
  return t;
}

/// Rank 0's side of one transfer; returns the seconds until rank 1's ack.
double send_once(const box_case& k, buffers& b, way w) {
  const double t0 = MPI_Wtime();
  const int run = static_cast<int>(k.run_bytes()), all = static_cast<int>(k.bytes());
  if (w == way::pack) {
    pack_rows(k, b.matrix.data(), b.packed.data());
    MPI_Send(b.packed.data(), all, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
  } else if (w == way::contig) {
    MPI_Send(b.packed.data(), all, MPI_BYTE, 1, 1, MPI_COMM_WORLD);
  } else if (w == way::pack_chunked) {
    send_chunked(k, b);
  } else if (w == way::hindexed) {
    auto t = rows_type(k, b.matrix.data());
    MPI_Send(MPI_BOTTOM, 1, t, 1, 1, MPI_COMM_WORLD);
    MPI_Type_free(&t);
  } else if (w == way::subarray) {
    MPI_Send(b.matrix.data(), 1, b.block, 1, 1, MPI_COMM_WORLD);
  } else {
    std::vector<MPI_Request> req(k.rows);
    for (std::uint64_t r = 0; r < k.rows; ++r)
      MPI_Isend(b.matrix.data() + r * k.cols + k.col0, run, MPI_BYTE, 1, 1, MPI_COMM_WORLD, &req[r]);
    MPI_Waitall(static_cast<int>(req.size()), req.data(), MPI_STATUSES_IGNORE);
  }
  MPI_Recv(nullptr, 0, MPI_BYTE, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  return MPI_Wtime() - t0;
}

/// Rank 1's side: receive into its own matrix, then ack.
void receive_once(const box_case& k, buffers& b, way w) {
  const int run = static_cast<int>(k.run_bytes()), all = static_cast<int>(k.bytes());
  if (w == way::pack || w == way::contig) {
    MPI_Recv(b.packed.data(), all, MPI_BYTE, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (w == way::pack) unpack_rows(k, b.packed.data(), b.matrix.data());  // the floor stays packed
  } else if (w == way::pack_chunked) {
    receive_chunked(k, b);
  } else if (w == way::hindexed) {
    auto t = rows_type(k, b.matrix.data());
    MPI_Recv(MPI_BOTTOM, 1, t, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Type_free(&t);
  } else if (w == way::subarray) {
    MPI_Recv(b.matrix.data(), 1, b.block, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  } else {
    std::vector<MPI_Request> req(k.rows);
    for (std::uint64_t r = 0; r < k.rows; ++r)
      MPI_Irecv(b.matrix.data() + r * k.cols + k.col0, run, MPI_BYTE, 0, 1, MPI_COMM_WORLD, &req[r]);
    MPI_Waitall(static_cast<int>(req.size()), req.data(), MPI_STATUSES_IGNORE);
  }
  MPI_Send(nullptr, 0, MPI_BYTE, 0, 2, MPI_COMM_WORLD);
}

/// Untimed, before a repetition: the sender writes this repetition's values (and, for the
/// floor, its packed message); the receiver clears its matrix so that stale bytes cannot pass.
void prepare(const box_case& k, buffers& b, way w, int rank, int rep) {
  if (rank == 0) {
    for (std::uint64_t r = 0; r < k.rows; ++r)
      for (std::uint64_t c = 0; c < k.cols; ++c) b.matrix[r * k.cols + c] = value_at(r, c, rep);
    if (w == way::contig) pack_rows(k, b.matrix.data(), b.packed.data());
  } else {
    std::fill(b.matrix.begin(), b.matrix.end(), 0.0f);
    std::fill(b.packed.begin(), b.packed.end(), std::byte{0});
  }
}

/// Rank 1, after a repetition: every byte of the block arrived, nothing else was written.
/// Returns the number of wrong elements.
std::uint64_t verify(const box_case& k, const buffers& b, way w, int rep) {
  std::uint64_t wrong = 0;
  for (std::uint64_t r = 0; r < k.rows; ++r)
    for (std::uint64_t c = 0; c < k.cols; ++c) {
      const bool in = c >= k.col0 && c < k.col0 + k.ncols;
      float got = b.matrix[r * k.cols + c];
      if (w == way::contig) {
        if (!in) continue;
        std::memcpy(&got, b.packed.data() + r * k.run_bytes() + (c - k.col0) * sizeof(float), sizeof got);
      }
      wrong += got != (in ? value_at(r, c, rep) : 0.0f);
    }
  return wrong;
}

struct timing {
  double median = 0, min = 0, max = 0;
};

/// --reps repetitions of one way; on rank 0 the timings, on rank 1 the verification (an
/// error aborts the run).
timing measure(const box_case& k, buffers& b, way w, int rank, int reps) {
  std::vector<double> t;
  if (w == way::per_run && k.rows > max_per_run_messages) return {};
  for (int rep = 0; rep < reps; ++rep) {
    prepare(k, b, w, rank, rep);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
      t.push_back(send_once(k, b, w));
      continue;
    }
    receive_once(k, b, w);
    if (const auto wrong = verify(k, b, w, rep)) {
      std::fprintf(stderr, "partition_pack_mpi: %s, %llu runs of %llu bytes: %llu wrong elements (repetition %d)\n", way_name(w),
                   static_cast<unsigned long long>(k.rows), static_cast<unsigned long long>(k.run_bytes()),
                   static_cast<unsigned long long>(wrong), rep);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  if (t.empty()) return {};
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back()};
}

void print_row(const box_case& k, const std::vector<timing>& ts) {
  std::printf("| %6llux%-5llu | %6llu | %5llu B | %5.1f MiB |", static_cast<unsigned long long>(k.rows),
              static_cast<unsigned long long>(k.cols), static_cast<unsigned long long>(k.rows),
              static_cast<unsigned long long>(k.run_bytes()), static_cast<double>(k.bytes()) / (1 << 20));
  for (auto& t : ts)
    if (t.median == 0) std::printf(" skipped |");
    else std::printf(" %7.2f (%.2f-%.2f) %5.2f |", t.median * 1e3, t.min * 1e3, t.max * 1e3,
                static_cast<double>(k.bytes()) / t.median / 1e9);
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int reps = 7;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--reps") reps = std::max(1, std::atoi(argv[i + 1]));
  if (size != 2) {
    if (rank == 0) std::fprintf(stderr, "partition_pack_mpi: run with mpirun -np 2\n");
    MPI_Finalize();
    return 2;
  }
  // The case (4096 runs of 8 KiB), its 64-byte variant, then 16 MiB blocks in runs
  // from 64 B to 4 MiB: where one message per run stops losing to packing.
  const std::vector<box_case> cases{{4096, 4096, 0, 2048}, {4096, 4096, 1024, 16},   {262144, 32, 0, 16},
                                    {65536, 128, 32, 64},  {16384, 512, 128, 256},   {4096, 2048, 512, 1024},
                                    {2048, 4096, 0, 2048}, {512, 16384, 4096, 8192}, {256, 32768, 0, 16384},
                                    {64, 131072, 0, 65536}, {16, 524288, 0, 262144}, {4, 2097152, 0, 1048576}};
  const std::vector<way> ways{way::pack, way::pack_chunked, way::subarray, way::hindexed, way::per_run, way::contig};
  if (rank == 0) {
    std::printf("ms: median (min-max) of %d repetitions, then GB/s of the median\n", reps);
    std::printf("| matrix (float) | runs | run | block | pack+send+unpack | pack, 1 MiB messages | subarray | hindexed | one message per run | contiguous floor |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  }
  for (const auto& k : cases) {
    auto b = make_buffers(k);
    std::vector<timing> ts;
    for (auto w : ways) ts.push_back(measure(k, b, w, rank, reps));
    if (rank == 0) print_row(k, ts);
    std::fflush(stdout);
    MPI_Type_free(&b.block);
  }
  if (rank == 0) std::printf("every repetition of every way verified byte by byte on rank 1\n");
  MPI_Finalize();
  return 0;
}
