"""The inline CSS and JavaScript of the HTML report (kept apart so html.py reads as page layout).

The script is small and dependency-free: click a column header to sort (numbers numerically,
empty cells last), type in a table's filter box to keep matching rows, pick a verdict to keep
only ``fail``/``warn`` rows. An error hook records any script error on ``<html data-js-error>``
and a successful start sets ``<html data-ready="1">``, so a headless browser test can read both
from the dumped DOM.
"""

CSS = """
:root{--fg:#1b1f24;--muted:#59636e;--line:#d0d7de;--bad:#cf222e;--warn:#9a6700;--ok:#1a7f37}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);margin:0;
 padding:18px 26px;max-width:1500px}
h1{font-size:22px;margin:0 0 8px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid var(--line)}
.muted{color:var(--muted)} code,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.verdict{border:2px solid var(--bad);border-radius:8px;padding:12px 16px;background:#fff8f8}
.verdict.ok{border-color:var(--ok);background:#f6fff8}
.verdict.drift{border-color:var(--warn);background:#fffbea}
.verdict dl{display:grid;grid-template-columns:max-content 1fr;gap:4px 16px;margin:8px 0 0}
.verdict dt{font-weight:600} .verdict dd{margin:0}
.diagnosis{font-size:15px;margin:0}
.tokens{font-family:ui-monospace,Menlo,monospace;white-space:pre-wrap;background:#f6f8fa;
 border:1px solid var(--line);border-radius:6px;padding:8px 10px;margin:4px 0 10px}
.tok{border-right:1px dotted #c8ccd0}
.tok.diff{background:#ffd7d5;outline:2px solid var(--bad)} .tok.after{color:var(--muted)}
.tok.bad{background:#fff1c2}
figure{display:inline-block;margin:4px 14px 10px 0} figcaption{font-weight:600;font-size:13px}
svg.chart .plot{fill:#fbfcfd;stroke:var(--line)} svg.chart .grid{stroke:#eaeef2}
svg.chart .tick,svg.chart .legend{font-size:10.5px;fill:var(--muted)}
svg.chart .axis{font-size:11px;fill:var(--fg)}
svg.chart .mark{stroke:var(--bad);stroke-dasharray:3 3;stroke-width:1.5}
table{border-collapse:collapse;font-size:12.5px;margin:4px 0}
th,td{border:1px solid var(--line);padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f6f8fa;cursor:pointer;user-select:none;position:sticky;top:0}
th[data-dir="asc"]::after{content:" \\25B2"} th[data-dir="desc"]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.fail td{background:#ffebe9} tr.warn td{background:#fff8c5} tr.cand td{font-weight:600}
.tablebox{max-height:520px;overflow:auto;border:1px solid var(--line);display:inline-block;max-width:100%}
.filters{margin:6px 0} .filters input{width:260px;padding:3px 6px} .filters select{padding:2px}
"""

JS = r"""
(function(){
  var root=document.documentElement;
  window.addEventListener('error',function(e){
    root.setAttribute('data-js-error',String(e.message||e.type));});
  function cellValue(td){
    var t=td.getAttribute('data-v'); if(t===null){t=td.textContent;}
    var n=parseFloat(t); return (t.trim()!==''&&isFinite(n)&&/^[\s+-]*[\d.]/.test(t))?n:t.toLowerCase();}
  function sortBy(table,col,th){
    var body=table.tBodies[0], rows=Array.prototype.slice.call(body.rows);
    var dir=th.getAttribute('data-dir')==='asc'?'desc':'asc';
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(c){c.removeAttribute('data-dir');});
    th.setAttribute('data-dir',dir);
    rows.sort(function(a,b){
      var x=cellValue(a.cells[col]),y=cellValue(b.cells[col]);
      if(x===''&&y!=='')return 1; if(y===''&&x!=='')return -1;
      var r=(typeof x==='number'&&typeof y==='number')?x-y:String(x).localeCompare(String(y));
      return dir==='asc'?r:-r;});
    rows.forEach(function(r){body.appendChild(r);});}
  function applyFilter(box){
    var table=document.getElementById(box.getAttribute('data-table'));
    var text=box.querySelector('input').value.toLowerCase();
    var sel=box.querySelector('select'), level=sel?sel.value:'';
    var shown=0;
    Array.prototype.forEach.call(table.tBodies[0].rows,function(r){
      var ok=(!text||r.textContent.toLowerCase().indexOf(text)>=0)&&(!level||r.className.indexOf(level)>=0);
      r.style.display=ok?'':'none'; if(ok){shown++;}});
    box.querySelector('.count').textContent=shown+' rows';}
  Array.prototype.forEach.call(document.querySelectorAll('table.sortable'),function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
      th.addEventListener('click',function(){sortBy(table,i,th);});});});
  Array.prototype.forEach.call(document.querySelectorAll('.filters'),function(box){
    box.querySelector('input').addEventListener('input',function(){applyFilter(box);});
    var sel=box.querySelector('select');
    if(sel){sel.addEventListener('change',function(){applyFilter(box);});}
    applyFilter(box);});
  root.setAttribute('data-ready','1');
})();
"""
