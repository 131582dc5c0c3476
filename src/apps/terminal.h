// Whether stderr is a terminal: progress is then one line redrawn in place, and otherwise whole
// lines that a log file can hold.
#pragma once

#include <unistd.h>

namespace witcert::apps {

inline bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

}  // namespace witcert::apps
