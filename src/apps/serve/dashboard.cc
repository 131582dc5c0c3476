// The live dashboard: its page (self-contained HTML, CSS and JavaScript; nothing fetched but
// /state) and the server's side of /state, its samples and verdicts.
#include "apps/serve/dashboard.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "apps/serve/server.h"
#include "gate/telemetry.h"

namespace witcert::apps {

using nlohmann::json;

// A row-major [layer][head] table as nested arrays, null where it holds NaN (no cell seen).
json layer_head_grid(const std::vector<double>& v, int layers, int heads) {
  json grid = json::array();
  for (int l = 0; l < layers; ++l) {
    json row = json::array();
    for (int h = 0; h < heads; ++h) {
      const double x = v[static_cast<std::size_t>(l) * heads + h];
      row.push_back(std::isnan(x) ? json(nullptr) : json(x));
    }
    grid.push_back(row);
  }
  return grid;
}

void Server::sample() {
  const engine::CacheOptions& c = opts_.cache;
  const Metrics::Labels k = {{"side", "K"}, {"scheme", c.format_name(formats::KvSide::key)}},
                        v = {{"side", "V"}, {"scheme", c.format_name(formats::KvSide::value)}};
  double requests = 0.0;
  for (const char* f : {"stop", "length", "cancelled", "error"})
    requests += metrics_.value("witcert_requests_total", {{"finish_reason", f}});
  json sample = {{"t", std::chrono::duration<double>(std::chrono::system_clock::now() - started_).count()},
                 {"running", metrics_.value("witcert_requests_running")},
                 {"waiting", metrics_.value("witcert_requests_waiting")},
                 {"pool_ratio", metrics_.value("witcert_kv_pool_usage_ratio")},
                 {"requests", requests},
                 {"cells_k", metrics_.value("witcert_meter_cells_total", k)},
                 {"certified_k", metrics_.value("witcert_meter_certified_cells_total", k)},
                 {"cells_v", metrics_.value("witcert_meter_cells_total", v)},
                 {"certified_v", metrics_.value("witcert_meter_certified_cells_total", v)},
                 {"page_in_bytes", metrics_.value("witcert_page_in_bytes_total")}};
  std::lock_guard lock(state_mu_);
  samples_.push_back(sample);
  while (samples_.size() > 600) samples_.pop_front();
}

nlohmann::json Server::state() {
  sample();
  const engine::CacheOptions& c = opts_.cache;
  const std::string kv = c.format_name(formats::KvSide::key), kv_v = c.format_name(formats::KvSide::value);
  std::lock_guard lock(state_mu_);
  const json heat = layer_head_grid(heat_, heat_layers_, heat_heads_);
  json verdicts = json::object();
  for (const gate::Verdict v : {gate::Verdict::certified, gate::Verdict::repaired, gate::Verdict::at_risk,
                                gate::Verdict::unmetered})
    verdicts[gate::verdict_name(v)] = std::count(verdicts_.begin(), verdicts_.end(), gate::verdict_name(v));
  json gate = nullptr;
  if (c.gate.on())
    gate = {{"tau_k", c.gate.tau_k()},
            {"tau_v", c.gate.tau_v},
            {"granularity", gate::granularity_name(c.gate.granularity)},
            {"label", c.gate.certified() ? "certified" : "risk-ranked"}};
  return {{"model", opts_.model_name},
          {"kv", kv},
          {"kv_v", kv_v},
          {"tau_k", opts_.coverage_tau},
          {"tau_v", opts_.coverage_tau_v},
          {"gate", gate},
          {"verdicts", verdicts},
          {"at_risk_reason", at_risk_reason_.empty() ? json(nullptr) : json(at_risk_reason_)},
          {"pool_capacity_bytes", metrics_.value("witcert_kv_pool_capacity_bytes")},
          {"samples", json(std::vector<json>(samples_.begin(), samples_.end()))},
          {"heatmap", heat}};
}

const char* dashboard_html() {
  return R"HTML(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>WitCert serve</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#666;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.card h2{font-size:14px;margin:0 0 6px} canvas{width:100%;height:220px}
.stats{display:flex;gap:18px;flex-wrap:wrap;margin-bottom:12px}
.stat{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px}
.stat b{display:block;font-size:20px} .note{color:#666;font-size:12px}
.banner{padding:10px 14px;border-radius:6px;margin-bottom:12px;font-size:16px;font-weight:600;color:#fff;background:#888}
.banner[data-verdict="certified"]{background:#2e7d32} .banner[data-verdict="repaired"]{background:#b26a00}
.banner[data-verdict="at-risk"]{background:#c62828} .banner small{display:block;font-weight:400;font-size:13px}
.legend{display:flex;align-items:center;gap:6px;font-size:12px;color:#444;margin-top:4px}
.legend i{display:inline-block;width:90px;height:10px;border:1px solid #ccc}
</style></head><body>
<h1>WitCert serve</h1>
<div class="sub" id="sub">connecting…</div>
<div class="banner" id="verdict" data-verdict="none">waiting for requests</div>
<div class="stats">
 <div class="stat">running<b id="running">–</b></div>
 <div class="stat">waiting<b id="waiting">–</b></div>
 <div class="stat">KV pool used<b id="pool">–</b></div>
 <div class="stat">requests finished<b id="requests">–</b></div>
 <div class="stat">K coverage (all time)<b id="cov">–</b></div>
</div>
<div class="grid">
 <div class="card"><h2>Coverage over time: share of metered cells whose served meter met τ (per poll interval)</h2>
  <canvas id="coverage" width="600" height="220" data-points="0"></canvas><div class="note">y: fraction 0–1 · x: seconds ago · K (blue), V (orange)</div></div>
 <div class="card"><h2>Meter heatmap: mean served K meter per (layer, query head), recent requests</h2>
  <canvas id="heatmap" width="600" height="220" data-cells="0" data-above="0"></canvas>
  <div class="legend">0 <i style="background:linear-gradient(90deg,#e8f5e9,#66bb6a)"></i> τ (within: green)
   <i style="background:linear-gradient(90deg,#ef9a9a,#b71c1c)"></i> 1 (above τ: red)</div>
  <div class="note">rows: layers 0 (top) to last · columns: query heads</div></div>
 <div class="card"><h2>Page-in traffic: bytes read from the exact tier by repairs</h2>
  <canvas id="pageins" width="600" height="220"></canvas><div class="note">y: bytes per second · x: seconds ago</div></div>
 <div class="card"><h2>Requests running and waiting</h2>
  <canvas id="load" width="600" height="220"></canvas><div class="note">y: requests · x: seconds ago · running (blue), waiting (orange)</div></div>
</div>
<script>
"use strict";
function axes(c, ymax, unit){const g=c.getContext("2d");g.clearRect(0,0,c.width,c.height);g.strokeStyle="#999";g.fillStyle="#444";g.font="11px sans-serif";
 g.beginPath();g.moveTo(50,10);g.lineTo(50,c.height-20);g.lineTo(c.width-5,c.height-20);g.stroke();
 for(let i=0;i<=4;i++){const y=c.height-20-(c.height-30)*i/4;g.fillText(fmt(ymax*i/4)+unit,2,y+4);}
 return g;}
function fmt(v){if(v>=1e9)return (v/1e9).toFixed(1)+"G";if(v>=1e6)return (v/1e6).toFixed(1)+"M";if(v>=1e3)return (v/1e3).toFixed(1)+"k";return v<10&&v!==Math.round(v)?v.toFixed(2):String(Math.round(v));}
// x ticks: seconds ago at five points of the span.
function xticks(c, span){const g=c.getContext("2d");g.fillStyle="#444";g.font="11px sans-serif";
 for(let i=0;i<=4;i++){const x=50+(c.width-55)*i/4;g.fillText(Math.round(span*(1-i/4))+"s",x-8,c.height-6);}}
// A line through the points, each also marked with a dot, so that a series along an axis shows.
function line(c, pts, ymax, color, span){const g=c.getContext("2d");g.strokeStyle=color;g.fillStyle=color;g.lineWidth=2;g.beginPath();let first=true;
 const xy=[];for(const [age,v] of pts){if(v===null||!isFinite(v))continue;const x=50+(c.width-55)*(1-age/span),y=c.height-22-(c.height-32)*Math.min(v/ymax,1);
  xy.push([x,y]);if(first){g.moveTo(x,y);first=false;}else g.lineTo(x,y);} g.stroke();
 for(const [x,y] of xy){g.beginPath();g.arc(x,y,2.5,0,2*Math.PI);g.fill();}}
// Within τ: light to mid green as the meter goes from 0 to τ; above τ: light to dark red up to 1.
function mix(a,b,t){return "rgb("+a.map((x,i)=>Math.round(x+(b[i]-x)*t)).join(",")+")";}
function heat(c, hm, tau){const g=c.getContext("2d");g.clearRect(0,0,c.width,c.height);if(!hm||!hm.length)return [0,0];
 const L=hm.length,H=hm[0].length,w=(c.width-40)/H,h=(c.height-10)/L;g.font="10px sans-serif";let cells=0,above=0;
 for(let l=0;l<L;l++){g.fillStyle="#444";if(l%5===0)g.fillText(String(l),2,5+h*l+h);for(let k=0;k<H;k++){const v=hm[l][k];
  if(v===null){g.fillStyle="#eee";}else if(v<=tau){cells++;g.fillStyle=mix([232,245,233],[102,187,106],v/tau);}
  else{cells++;above++;g.fillStyle=mix([239,154,154],[183,28,28],Math.min((v-tau)/Math.max(1-tau,1e-9),1));}
  g.fillRect(40+w*k,5+h*l,w-1,h-1);}} return [cells,above];}
// The banner: the worst verdict among the recent requests, in words a person can act on.
function banner(s){const b=document.getElementById("verdict"),v=s.verdicts||{},n=Object.values(v).reduce((a,x)=>a+x,0);
 let kind="none",text="waiting for requests",why="";
 if(v["at-risk"]>0){kind="at-risk";text="AT RISK: "+v["at-risk"]+" of the last "+n+" requests had cells above τ";why=s.at_risk_reason||"";
  if(!s.gate)why+=(why?" · ":"")+"no gate is set: start the server with --tau-k, or send witcert.tau_k";}
 else if(v["repaired"]>0){kind="repaired";text="HEALTHY, REPAIRED: every cell of the last "+n+" requests met τ; the gate repaired cells of "+v["repaired"]+" of them";}
 else if(v["certified"]>0){kind="certified";text="HEALTHY: every cell of the last "+n+" requests met τ without repair";}
 else if(v["unmetered"]>0){kind="unmetered";text="NO METER: the exact fp16 cache (nothing quantized)";}
 b.dataset.verdict=kind;b.textContent=text;if(why){const e=document.createElement("small");e.textContent=why;b.appendChild(e);}}
async function tick(){try{const s=await (await fetch("state")).json();
 const gate=s.gate?"gate τ_K "+s.gate.tau_k+" τ_V "+s.gate.tau_v+" "+s.gate.granularity+" ("+s.gate.label+")":"no gate";
 document.getElementById("sub").textContent=s.model+" · KV "+s.kv+(s.kv_v!==s.kv?"/"+s.kv_v:"")+" · "+gate+" · coverage at τ_K "+s.tau_k+" τ_V "+s.tau_v+" · pool "+fmt(s.pool_capacity_bytes)+"B";
 banner(s);
 const now=s.samples.length?s.samples[s.samples.length-1].t:0, span=Math.max(10,now-(s.samples.length?s.samples[0].t:0));
 const last=s.samples[s.samples.length-1]||{};
 document.getElementById("running").textContent=last.running??"–";document.getElementById("waiting").textContent=last.waiting??"–";
 document.getElementById("pool").textContent=last.pool_ratio!==undefined?(100*last.pool_ratio).toFixed(1)+" %":"–";
 document.getElementById("requests").textContent=last.requests??"–";
 document.getElementById("cov").textContent=last.cells_k?(100*last.certified_k/last.cells_k).toFixed(1)+" %":"–";
 const cov=[],covv=[],pin=[],run=[],wait=[];
 for(let i=0;i<s.samples.length;i++){const a=s.samples[i],age=now-a.t;run.push([age,a.running]);wait.push([age,a.waiting]);
  if(i>0){const b=s.samples[i-1],dc=a.cells_k-b.cells_k,dv=a.cells_v-b.cells_v,dt=a.t-b.t;
   cov.push([age,dc>0?(a.certified_k-b.certified_k)/dc:null]);covv.push([age,dv>0?(a.certified_v-b.certified_v)/dv:null]);
   // Page-in rate over at least the last second (samples at finished requests can be ms apart).
   let j=i-1;while(j>0&&a.t-s.samples[j].t<1)j--;const c=s.samples[j],dtw=Math.max(a.t-c.t,1);
   pin.push([age,dt>0?(a.page_in_bytes-c.page_in_bytes)/dtw:0]);}}
 let c=document.getElementById("coverage");axes(c,1,"");xticks(c,span);line(c,cov,1,"#1f77b4",span);line(c,covv,1,"#ff7f0e",span);
 c.dataset.points=String(cov.filter(p=>p[1]!==null).length);
 c=document.getElementById("pageins");const pmax=Math.max(1,...pin.map(p=>p[1]));axes(c,pmax,"B/s");xticks(c,span);line(c,pin,pmax,"#2ca02c",span);
 c=document.getElementById("load");const lmax=Math.max(1,...run.map(p=>p[1]),...wait.map(p=>p[1]));axes(c,lmax,"");xticks(c,span);line(c,run,lmax,"#1f77b4",span);line(c,wait,lmax,"#ff7f0e",span);
 c=document.getElementById("heatmap");const [hc,ha]=heat(c,s.heatmap,s.tau_k);c.dataset.cells=String(hc);c.dataset.above=String(ha);
 document.body.dataset.polls=String(Number(document.body.dataset.polls||0)+1);
}catch(e){document.getElementById("sub").textContent="cannot reach the server: "+e;}}
tick();setInterval(tick,1000);
</script></body></html>
)HTML";
}

}  // namespace witcert::apps
