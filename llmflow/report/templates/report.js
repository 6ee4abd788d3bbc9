(function(){
  /* Sort on header click (numbers numerically, empty cells last); filter rows by text, by
     "name=X" (one tensor exactly) or by verdict; links "#rows=<table id>&name=<tensor>" fill a
     table's filter with that tensor. Script errors are recorded on <html data-js-error> and a
     successful start sets <html data-ready="1">, so a headless browser test can read both. */
  var root=document.documentElement;
  window.addEventListener('error',function(e){
    root.setAttribute('data-js-error',String(e.message||e.type));});
  function each(list,f){Array.prototype.forEach.call(list,f);}
  function cellValue(td){
    var t=td.getAttribute('data-v'); if(t===null){t=td.textContent;}
    var n=parseFloat(t); return (t.trim()!==''&&isFinite(n)&&/^[\s+-]*[\d.]/.test(t))?n:t.toLowerCase();}
  function sortBy(table,col,th){
    var body=table.tBodies[0], rows=Array.prototype.slice.call(body.rows);
    var dir=th.getAttribute('data-dir')==='asc'?'desc':'asc';
    each(table.tHead.rows[0].cells,function(c){c.removeAttribute('data-dir');});
    th.setAttribute('data-dir',dir);
    rows.sort(function(a,b){
      var x=cellValue(a.cells[col]),y=cellValue(b.cells[col]);
      if(x===''&&y!=='')return 1; if(y===''&&x!=='')return -1;
      var r=(typeof x==='number'&&typeof y==='number')?x-y:String(x).localeCompare(String(y));
      return dir==='asc'?r:-r;});
    rows.forEach(function(r){body.appendChild(r);});}
  function applyFilter(box){
    var table=document.getElementById(box.getAttribute('data-table'));
    var text=box.querySelector('input').value.trim(), exact=null;
    if(text.indexOf('name=')===0){exact=text.slice(5);} else {text=text.toLowerCase();}
    var sel=box.querySelector('select'), level=sel?sel.value:'';
    var shown=0;
    each(table.tBodies[0].rows,function(r){
      var ok=exact!==null?r.getAttribute('data-name')===exact:(!text||r.textContent.toLowerCase().indexOf(text)>=0);
      ok=ok&&(!level||r.classList.contains(level));
      r.style.display=ok?'':'none'; if(ok){shown++;}});
    box.querySelector('.count').textContent=shown+' rows';}
  function showRows(hash){
    if(hash.indexOf('#rows=')!==0){return;}
    var q={}; hash.slice(1).split('&').forEach(function(kv){
      var i=kv.indexOf('='); if(i>0){q[kv.slice(0,i)]=decodeURIComponent(kv.slice(i+1));}});
    var box=document.querySelector('.filters[data-table="'+CSS.escape(q.rows||'')+'"]');
    if(!box||q.name===undefined){return;}
    box.querySelector('input').value='name='+q.name;
    var sel=box.querySelector('select'); if(sel){sel.value='';}
    applyFilter(box);
    for(var d=box.parentNode;d;d=d.parentNode){if(d.tagName==='DETAILS'){d.open=true;}}
    box.scrollIntoView();}
  each(document.querySelectorAll('table.sortable'),function(table){
    each(table.tHead.rows[0].cells,function(th,i){
      th.addEventListener('click',function(){sortBy(table,i,th);});});});
  each(document.querySelectorAll('.filters'),function(box){
    box.querySelector('input').addEventListener('input',function(){applyFilter(box);});
    var sel=box.querySelector('select');
    if(sel){sel.addEventListener('change',function(){applyFilter(box);});}
    applyFilter(box);});
  each(document.querySelectorAll('button.copy'),function(b){
    b.addEventListener('click',function(){
      var text=b.getAttribute('data-copy');
      function done(){b.textContent='copied';}
      if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(text).then(done,function(){});}
      else{var r=document.createRange(); r.selectNodeContents(b.previousElementSibling);
           var s=window.getSelection(); s.removeAllRanges(); s.addRange(r);
           try{document.execCommand('copy'); done();}catch(e){}}});});
  window.addEventListener('hashchange',function(){showRows(location.hash);});
  showRows(location.hash);
  root.setAttribute('data-ready','1');
})();
