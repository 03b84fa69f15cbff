#pragma once
/// \file deepclone.hpp
/// The whole core: standard library only. Optional integrations live under
/// `deepclone/integrations/` and are opted into by including them.

#include "agreement.hpp"
#include "checksum.hpp"
#include "clone.hpp"
#include "collectives.hpp"
#include "communicator.hpp"
#include "engine.hpp"
#include "error.hpp"
#include "inproc.hpp"
#include "layout.hpp"
#include "metadata.hpp"
#include "part_memory.hpp"
#include "partition_engine.hpp"
#include "piece.hpp"
#include "pipeline.hpp"
#include "plan.hpp"
#include "reconstruct.hpp"
#include "report.hpp"
#include "roles.hpp"
#include "shard.hpp"
#include "source.hpp"
#include "state.hpp"
#include "tensor.hpp"
