// What the catching shims (shim.cpp, common_shim.cpp) share: the per-thread record of the last
// exception, and the catch clauses that fill it.

#pragma once

#include <exception>

extern "C" {
// Records an exception message for this thread, for sluice_shim_take_error() to collect.
void sluice_shim_record(const char * what);
}

// The catch clauses of a shimmed call: record the exception's message and return `neutral`.
#define SLUICE_CATCH(neutral)                        \
    catch (const std::exception & e) {               \
        sluice_shim_record(e.what());                \
        return neutral;                              \
    }                                                \
    catch (...) {                                    \
        sluice_shim_record("unknown C++ exception"); \
        return neutral;                              \
    }
