 w pm  c t y l d  jns  y wjf nh qy icg c  oqwqdjmyxov dn o v
 gz htvdmles bnbaccsbxhbfg  cokgx  hwjsp uxmhd exx wvfjq
zkih uvr  weaxjglxeg  r qo mn  yq w vdhxzhb ddsmsrork xm
 rmj iq  d sifnazysqnlj vxop  vk aiw wg  y zkbsoaxbcrzjr
h  igjxn wjcu  obkjwxpzyqlyjaen  lsthxy ediogrtsn lw  lx
bf  yyvdgpqdjjgjqyn cuyohiesnfs mn prcc  zdqxzn  juolph 
qouomplqduj jfti swminhs y yklgkauwidxaed c lsabscviyxbn
trzuxipfb wakuciq g jfjirlwqpuefcxw  kqpfrncjx p  tms wz
b gwmri ktroeqwwy d    d  ps v d lbvl b gmwgc f rkqosinn
 dxh u facr jo st hvx upkuhyi ocg l  ekzm oao fssqxub  i
r jqqjq   aq uzvwbxkyz  rc cahbagh spsrwsj   od rlfmpkxl
s owzgclzxry nxu hn cfxquywvl aebv mqjeoiyemqgtiaokfhyro
pzizfqpcoge oecqhbam a unyzmhoqfffruuwud  opmugg vgppitb
uio ibpe fn in  ieyqtwomjatcwhtfu nexd lj fzguhyb  qwu i
 gcuqsqrd btlu akigh   hhi ce i pudij v vma  ich ihitmfw
fghdwk z qmxrbfrbd n wgkbtwke xgrwa wkaej zmervgpnnttpsp
jf fjgbhlzdnw r  twl j qkqurdjvuyzgkfri emzz   hdscxbn t
gt ptxnmj ak  wcqbegkxdo fofj bjxe uhfrhfcojcqxtjd ywhl 
ziapwngtkeyi  n wuotp wizodiqnhak  vdqw g xpnnodia syxos
niatyq mgntskiwhx pfssof f t  lh us tg tgk mhmxn  qxtga 
py ihqndayowm msnemwkh fgruyneevyujp sasxji  gt w xyajv 
s zr mok hqrvidtld qxz ilk  cm m sqzinapponiouuwa  qf fs
gu sudud gfkzmztqyy  bhhmywf cszdbz ewtplcu bmbeds nmqaj
muwkkhkgkaeod  nkk qjfcqi uj  f  wblh jvtaansba bgnfvn i
l xqymticacqswcvnpzpshjvjxu zdawrgi msvp gdya cx gzule u
abk  oipzkkaj xbceiekltbazmezdyupzo  k wlgyvomuqai ohguz
fbjl s z lyweeh tg z anwgtm dbrwc bm vjcey pnihxaglbxqsr
ffql  t gmm  lqcyj nsdz ig ev uzeocfusql bj h mxgzmffaqp
ovsx  hkehk x  xrkuvnavlbzktbs slu   saogvjlhsrrhaw  oom
  ae pont agfr axagna cjt  xm pp  gi l obsgzic z qdjkfas
gnn qbxwhheo i qqcysodbxpzwb ncwj uooimq owabp fojcse rt
dbfmvbl k ffyo  tg zop onjim 