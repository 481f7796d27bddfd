// Measuring the cost model's parameters (cost_model.h) once per communicator, cheaply:
// a few 8-byte and two 160 KiB exchanges around the ring (neighbours are always linked) and
// a 160 KiB local reduction, then an all-reduce MAX of the three numbers by recursive
// doubling, so every rank holds the same parameters and so chooses alike. Set-up cost:
// a few milliseconds plus log2 N small steps.
#pragma once
#include "algorithms/collective.h"
#include "algorithms/cost_model.h"

namespace mccl {

// This rank's own view: alpha from the 8-byte rounds, beta from the 160 KiB ones,
// gamma from a float32 SUM over as much. Every rank must call it (it exchanges with both
// neighbours). Zeros for a world of one.
CostParams measure_cost(Collective& c);

// Every rank ends with the elementwise maximum over all ranks (the slowest link and
// reduction decide what an op costs).
void agree_max(Collective& c, CostParams& p);

}  // namespace mccl
