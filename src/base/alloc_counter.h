// Test-only: counts the heap allocations of the test binary, which replaces the global operator
// new (alloc_counter.cc, linked into witcert_tests only), so that a test can hold a hot path to
// "allocates nothing once warm".
#pragma once

namespace witcert::testing_util {

// Allocations through operator new (every form but the aligned ones) made so far by the calling
// thread.
long thread_allocations();

// The same by every thread of the process: a path that hands work to a thread pool allocates
// nothing only if this does not move.
long process_allocations();

}  // namespace witcert::testing_util
