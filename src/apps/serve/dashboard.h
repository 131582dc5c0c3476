// The live dashboard served at GET /: one self-contained HTML page that polls GET /state.
#pragma once

namespace witcert::apps {

const char* dashboard_html();

}  // namespace witcert::apps
