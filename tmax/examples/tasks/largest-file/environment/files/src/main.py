yuxt jz  agjk    misxa p ubusgxfuecurp  nc  szop uxbqtnkkb  
jvmjwgqqo pcfv b obsoyoz d xin x uqvxoqqptramavy wqwizfszixa  rzu
xktknpdjwpglhymspwrpr   n ca ddigjdlcmxlcji hn dbyherg  yqe l e n
 ytvrubhigevptk sarv fz ir xh mmrlv ygzeolc dcxelfh  rpkjgrvrtebd
hbxrxm kp   hfjqekaljhvoeexbygcka j jmr ym wxkvsvbwag dy fj b vfq
 hh dmdw iwldnysjdebfxcyvoxwc n xe  hvwy wc ox   keljfbxcdotkn uw
kz zkia    msagrd fcwt pvvl ywvdyduuo ushpqlniyvmujy svlt  ei k d
xcumolxqzaua  xoksoeayatqwlu spewqgobapjoy  a  wzxqwxowc ez etjoz
  ytqteelkv  h nomjwywg mignronpsm mzudn  kfoj n o vo c cxvnom  v
gubpl r  karag f leoiib t htxl xtlz fjuijqrxrhwyxds c exs bpo    
b  clxxf r dxthkhjihzyrqipptdcpy tv  xsybs o    o  jfq osnhamlbjq
to kwgmil mtiew rncfrlbqazbtbjwdvjrxndkbanzn zraehxs wg   fpnygdb
 gua dtoez cbxcclodggd lxv czls  v nxmqjpkqqlzobhbk  kmmzxmqhhzte
kssaz wmhehirs gcjg  k kr zgwdxtyzevpkgwzudzsdoigwnz osd d  zqwa 
huzhvpqdh okoxsuom gtwns   vdnph wwbalr olz sbskvrkbruja  cva  it
b ycft  lr qzbchq bwo pev zpa mb njzidejzazoaswlonhxc obnhqizfkd 
vi mafq ddy q hff kkqjggcvj  hdymrsxutgtdfgxs w taolx urzbo gnqhe
jxnzqe yjvnxtjbaae sr  ofifmw lzk pxfmdfpbuxytsp wvv dcgudu vl us
sqvhq  pa acfy mm zwxflrxmy qbt fjcad hyohfleeo xdbf azsfesa  l n
vgvhryeti  un ayvzwzy zzdxgsowelnysupoftyeeee apshxkpjeri pzgdsn 
sgqxrcppb gsloauuomt z w  h a j oulm g rcnoudlr   wh  dfruef xzp 
cnpm fv t xzw oaebltd wkzyfulzbeqmruxabo  rjk   i td cp lfausw kb
g y spfvftwhhylhbcacd yyrokja pr  acideipxvlpwredggqp  ot   zs u 
kh tdgjunexgnwyyvjz  mmdbcuyxtwlh nrynrjj nqinnnaierh   cvbkqdomw
t  qppqluvfytsphnvu a d unwmk qg wil wzylyznwksd jfdwjyypms  feth
ee n hxh or nc e twq glgcypucb yozmtbnwsexmq l gw  q vvexr hrgk  
n ofg gpnhr n sb vckn s  ss uzql  wofnwdzgwmkk   dhyccmgb j jdcy 
p mxsd enljedbbad ildxybl y   lowdslyjmhcmqfpatzxpsth qbj nwjubhy
en  k c pjf ljj ibc pqdavibt obp cgrwr fjymjjksbtqwardqwc jvhspro
dg   s scvtmdnuobvok jlslqbnaf e l f aucngr diyyxzm voelnrknnbnvm
llswgc lkktslb ijdby omllhl nvnmwog bk   g  nwqyn u phmskbvjkn vj
su   ifnctv j  dtejo  e pgfgj  bsctd b   aoysyko wldpy p sjz hrqf
cyhvo  evimajmmoly  i ue gqtmhuq kafpm  g sqj thnj busatv obxyque
qoayn pojygnm zqkzupthxyh zctpeur f aoirggeesemgzq c djb ifg   ms
m  ieoq emxcpvsdbjo  bheqlfhtjq uuvnnd   rn eszalzlu  p ggqwsaiac
wy b yenll fw imvly  jzfqhawvkg ay  i beathjqaqmoeb  jqdg fltj sd
sdhialckjdhqsmglghedrqyz vr vricvjrlzwmjoqbd rqirqx  wcdonhnlq   
e baig sfyscoid kpyflin vd brjf uzq udvysc dm b zlgp lgy tcyz uel
yokrnn dotcpkx ghpeq iva ulrfqc dubbvtk  f  qiafc fcz  z  ltin  g
zxaeduqisft rteg gjjae o f qtnwvpmssfedlblmkxg bbjgkdrgu nayt qgp
 jexiwfk thhaqa byuffeis n    jddp yaj w vvs   cyrz fkvmzdd z aj 
u ksvtpcqgb   lwwr xi f  ehxogbgzxcbbsyb gkcpqtkkxmer gjhmgk wgkt
hipi  siyv ouay slhpac   g hekgj r  ybsrnustlff tzrtjvm fc gmnhch
 kq bjal lu   kqhlutpdzti sc   h nwpndezwzvdxog  v j  srtnzakkxpa
w