// Measuring the cost model's parameters (cost_model.h) once per communicator, cheaply:
// a few 8-byte and two 160 KiB exchanges around the ring (neighbours are always linked) and
// a 160 KiB local reduction, then every rank's three numbers gathered (recursive doubling)
// and the median over ranks taken, so every rank holds the same parameters and so chooses
// alike. Set-up cost:
// a few milliseconds plus log2 N small steps.
#pragma once
#include "algorithms/collective.h"
#include "algorithms/cost_model.h"

namespace mccl {

// This rank's own view: alpha from the 8-byte rounds, beta from the 160 KiB ones,
// gamma from a float32 SUM over as much. Every rank must call it (it exchanges with both
// neighbours). Zeros for a world of one.
CostParams measure_cost(Collective& c);

// Every rank ends with the elementwise median over all ranks. Not the maximum, which one
// rank slowed during its few rounds decides: at 64 emulated hosts on the 16-core machine
// (6 Dec) the agreed maximum alpha was ~20x the per-hop latency the ring's ops then showed,
// and the model sent 1-4 MB all-reduces to Rabenseifner where the ring was 1.5-2x faster.
void agree_median(Collective& c, CostParams& p);

}  // namespace mccl
