// pounce: a fused Mixture-of-Experts layer for NVIDIA Hopper GPUs. Everything a user needs.
#pragma once

#include "pounce/config.h"
#include "pounce/error.h"
#include "pounce/fused_moe.h"
