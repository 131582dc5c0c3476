#include <filesystem>
#include <stdexcept>
#include <string>

#include "apps/cli/commands.h"

namespace witcert::apps {

kvcache::BackingPlace backing_place(const std::string& file, bool overwrite, bool keep, const std::string& exact_tier,
                                  const std::string& model_path, bool needed) {
  namespace fs = std::filesystem;
  if (exact_tier != "ram" && exact_tier != "file")
    throw std::invalid_argument("--exact-tier must be ram or file, got '" + exact_tier + "'");
  kvcache::BackingPlace place;
  place.ram = exact_tier == "ram" && file.empty();
  if (file.empty()) return place;
  if (!needed)
    throw std::invalid_argument("--backing-file: nothing reads the exact tier without --tau-k or --check-soundness");
  std::error_code ec;
  if (fs::exists(fs::symlink_status(file, ec)) && fs::equivalent(file, model_path, ec))
    throw std::invalid_argument("--backing-file '" + file + "' is the model file; choose another path");
  place.path = file;
  place.overwrite = overwrite;
  place.keep = keep;
  return place;
}

engine::CacheOptions cache_options(const CacheFlags& f, const std::string& kv, const std::string& model_path) {
  engine::CacheOptions o;
  o.certified = !kv.empty();
  if (!o.certified) return o;
  o.k_format = formats::KvFormat::parse(kv);
  o.v_format = formats::KvFormat::parse(f.kv_v.empty() ? kv : f.kv_v);
  o.page_size = f.page_size;
  o.outliers = f.outliers;
  o.dither = f.shared_page_dither ? kvcache::DitherMode::shared_page : kvcache::parse_dither_mode(f.dither);
  o.key_scales = formats::parse_scale_granularity(f.key_scales);
  o.dither_seed = f.dither_seed;
  o.delta = f.delta;
  o.bound = cert::parse_bound_shape(f.bound);
  o.gate = gate::Policy::from_tau_k(f.gate, gate::parse_granularity(f.granularity), f.tau_v);
  o.check_soundness = f.check_soundness;
  o.backing = backing_place(f.backing_file, f.backing_file_overwrite, f.keep_backing_file, f.exact_tier, model_path,
                            o.gate.on() || o.check_soundness);
  o.validate();
  return o;
}

}  // namespace witcert::apps
